/* The few ONNX Runtime C API declarations the epmem ORT test needs.
 *
 * The onnxruntime wheel ships libonnxruntime.so but no headers, so this test
 * declares what it uses by hand, like src/ort/abi.rs does on the plugin side.
 * Function-table slots are indices into OrtApi (append-only since 1.0; the
 * indices below are those of docs/ORT_ABI.md and of onnxruntime_c_api.h).
 */
#ifndef EPMEM_ORT_MIN_H
#define EPMEM_ORT_MIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtEnv OrtEnv;
typedef struct OrtEpDevice OrtEpDevice;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtKeyValuePairs OrtKeyValuePairs;
typedef struct OrtValue OrtValue;
typedef struct OrtSyncStream OrtSyncStream;
typedef void OrtApi; /* used only as a table of slots */

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

const OrtApiBase* OrtGetApiBase(void);

typedef struct OrtAllocator {
  uint32_t version;
  void* (*Alloc)(struct OrtAllocator* self, size_t size);
  void (*Free)(struct OrtAllocator* self, void* p);
  const OrtMemoryInfo* (*Info)(const struct OrtAllocator* self);
  void* (*Reserve)(struct OrtAllocator* self, size_t size);
  OrtStatus* (*GetStats)(const struct OrtAllocator* self, OrtKeyValuePairs** out);
  void* (*AllocOnStream)(struct OrtAllocator* self, size_t size, OrtSyncStream* stream);
  OrtStatus* (*Shrink)(struct OrtAllocator* self);
} OrtAllocator;
_Static_assert(sizeof(OrtAllocator) == 64, "OrtAllocator is 64 bytes");

enum { ORT_LOGGING_LEVEL_WARNING = 2 };
enum { OrtDeviceMemoryType_DEFAULT = 0, OrtDeviceMemoryType_HOST_ACCESSIBLE = 5 };
enum { OrtDeviceAllocator = 0, OrtArenaAllocator = 1 };
enum { ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1 };

/* OrtApi slots. */
enum {
  SLOT_CreateStatus = 0,
  SLOT_GetErrorCode = 1,
  SLOT_GetErrorMessage = 2,
  SLOT_CreateEnv = 3,
  SLOT_CreateTensorAsOrtValue = 48,
  SLOT_GetTensorMutableData = 51,
  SLOT_GetAllocatorWithDefaultOptions = 78,
  SLOT_ReleaseEnv = 92,
  SLOT_ReleaseStatus = 93,
  SLOT_ReleaseValue = 96,
  SLOT_CreateKeyValuePairs = 295,
  SLOT_AddKeyValuePair = 296,
  SLOT_GetKeyValue = 297,
  SLOT_ReleaseKeyValuePairs = 300,
  SLOT_RegisterExecutionProviderLibrary = 301,
  SLOT_UnregisterExecutionProviderLibrary = 302,
  SLOT_GetEpDevices = 303,
  SLOT_EpDevice_EpName = 312,
  SLOT_EpDevice_EpMetadata = 314,
  SLOT_AllocatorGetStats = 319,
  SLOT_EpDevice_MemoryInfo = 374,
  SLOT_CreateSharedAllocator = 375,
  SLOT_GetSharedAllocator = 376,
  SLOT_ReleaseSharedAllocator = 377,
  SLOT_CopyTensors = 386,
};

/* Typed views of the slots above. */
typedef OrtStatus* (*PFN_CreateEnv)(int level, const char* id, OrtEnv** out);
typedef OrtStatus* (*PFN_CreateTensorAsOrtValue)(OrtAllocator* a, const int64_t* shape, size_t rank, int type, OrtValue** out);
typedef OrtStatus* (*PFN_GetTensorMutableData)(OrtValue* v, void** out);
typedef OrtStatus* (*PFN_GetAllocatorWithDefaultOptions)(OrtAllocator** out);
typedef void (*PFN_ReleaseEnv)(OrtEnv*);
typedef const char* (*PFN_GetErrorMessage)(const OrtStatus*);
typedef void (*PFN_ReleaseStatus)(OrtStatus*);
typedef void (*PFN_ReleaseValue)(OrtValue*);
typedef void (*PFN_CreateKeyValuePairs)(OrtKeyValuePairs** out);
typedef void (*PFN_AddKeyValuePair)(OrtKeyValuePairs* kv, const char* k, const char* v);
typedef const char* (*PFN_GetKeyValue)(const OrtKeyValuePairs* kv, const char* k);
typedef void (*PFN_ReleaseKeyValuePairs)(OrtKeyValuePairs* kv);
typedef OrtStatus* (*PFN_RegisterExecutionProviderLibrary)(OrtEnv* env, const char* name, const char* path);
typedef OrtStatus* (*PFN_UnregisterExecutionProviderLibrary)(OrtEnv* env, const char* name);
typedef OrtStatus* (*PFN_GetEpDevices)(const OrtEnv* env, const OrtEpDevice* const** devs, size_t* n);
typedef const char* (*PFN_EpDevice_EpName)(const OrtEpDevice* d);
typedef const OrtKeyValuePairs* (*PFN_EpDevice_EpMetadata)(const OrtEpDevice* d);
typedef OrtStatus* (*PFN_AllocatorGetStats)(const OrtAllocator* a, OrtKeyValuePairs** out);
typedef const OrtMemoryInfo* (*PFN_EpDevice_MemoryInfo)(const OrtEpDevice* d, int mem_type);
typedef OrtStatus* (*PFN_CreateSharedAllocator)(OrtEnv* env, const OrtEpDevice* d, int mem_type, int alloc_type,
                                                const OrtKeyValuePairs* options, OrtAllocator** out);
typedef OrtStatus* (*PFN_GetSharedAllocator)(OrtEnv* env, const OrtMemoryInfo* mi, OrtAllocator** out);
typedef OrtStatus* (*PFN_ReleaseSharedAllocator)(OrtEnv* env, const OrtEpDevice* d, int mem_type);
typedef OrtStatus* (*PFN_CopyTensors)(const OrtEnv* env, const OrtValue* const* src, OrtValue* const* dst,
                                      OrtSyncStream* stream, size_t n);

/* ORT_FN(api, Name): the typed function in slot SLOT_Name. */
#define ORT_FN(api, name) ((PFN_##name)((void* const*)(api))[SLOT_##name])

#endif
