/* The OrtApi slots the CUDA-EP test needs beyond ../ort_min.h (indices from
 * onnxruntime_c_api.h; the table is append-only). */
#ifndef EPMEM_ORT_GPU_MIN_H
#define EPMEM_ORT_GPU_MIN_H
#include "../ort_min.h"

typedef struct OrtSession OrtSession;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtRunOptions OrtRunOptions;
typedef struct OrtCUDAProviderOptionsV2 OrtCUDAProviderOptionsV2;

enum {
  SLOT_CreateSession = 7,
  SLOT_Run = 9,
  SLOT_CreateSessionOptions = 10,
  SLOT_CreateTensorWithDataAsOrtValue = 49,
  SLOT_CreateCpuMemoryInfo = 69,
  SLOT_ReleaseMemoryInfo = 94,
  SLOT_ReleaseSession = 95,
  SLOT_ReleaseSessionOptions = 100,
  SLOT_AddSessionConfigEntry = 130,
  SLOT_SessionOptionsAppendExecutionProvider_CUDA_V2 = 204,
  SLOT_CreateCUDAProviderOptions = 205,
  SLOT_ReleaseCUDAProviderOptions = 208,
};

typedef OrtStatus* (*PFN_CreateSession)(const OrtEnv* env, const char* path, const OrtSessionOptions* so, OrtSession** out);
typedef OrtStatus* (*PFN_Run)(OrtSession* s, const OrtRunOptions* ro, const char* const* in_names, const OrtValue* const* in,
                              size_t n_in, const char* const* out_names, size_t n_out, OrtValue** out);
typedef OrtStatus* (*PFN_CreateSessionOptions)(OrtSessionOptions** out);
typedef OrtStatus* (*PFN_CreateTensorWithDataAsOrtValue)(const OrtMemoryInfo* mi, void* data, size_t len, const int64_t* shape,
                                                         size_t rank, int type, OrtValue** out);
typedef OrtStatus* (*PFN_CreateCpuMemoryInfo)(int alloc_type, int mem_type, OrtMemoryInfo** out);
typedef void (*PFN_ReleaseMemoryInfo)(OrtMemoryInfo*);
typedef void (*PFN_ReleaseSession)(OrtSession*);
typedef void (*PFN_ReleaseSessionOptions)(OrtSessionOptions*);
typedef OrtStatus* (*PFN_AddSessionConfigEntry)(OrtSessionOptions* so, const char* k, const char* v);
typedef OrtStatus* (*PFN_SessionOptionsAppendExecutionProvider_CUDA_V2)(OrtSessionOptions* so, const OrtCUDAProviderOptionsV2* o);
typedef OrtStatus* (*PFN_CreateCUDAProviderOptions)(OrtCUDAProviderOptionsV2** out);
typedef void (*PFN_ReleaseCUDAProviderOptions)(OrtCUDAProviderOptionsV2*);

#endif
