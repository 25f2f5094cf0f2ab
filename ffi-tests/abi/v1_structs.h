/*
 * The first published version (epmem 0.1, ABI v1) of every versioned struct,
 * frozen: copied by hand from include/epmem.h as it was when the sizes were
 * frozen, and never edited since. A C client built against these (see
 * ffi-tests/test_abi_v1.c) is what a binary compiled years ago looks like to
 * today's library; the layout table at the end is the published layout that
 * no later header may move.
 *
 * Never change this file: when a struct grows, the current header's struct
 * gets new trailing fields and this copy stays as it is. (EpmKvSeqInfo was
 * flattened before the freeze: it no longer embeds an EpmKvLayout.)
 * EpmKvBatchDesc and EpmKvBatchSlotInfo were published in the same version
 * (the KV batch API, merged alongside the freeze) and were added to this
 * table afterwards, copied from that header; they are frozen like the rest.
 */
#ifndef EPMEM_ABI_V1_STRUCTS_H
#define EPMEM_ABI_V1_STRUCTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct EpmDeviceInfo_v1 {
  size_t size;
  uint32_t kind; /* EpmDeviceKind: an int-sized C enum */
  uint32_t ordinal;
  uint64_t total_memory;
  uint64_t granularity;
  uint32_t compute_capability_major;
  uint32_t compute_capability_minor;
  uint32_t driver_version;
  char name[256];
  char pci_bus_id[32];
} EpmDeviceInfo_v1;
_Static_assert(sizeof(EpmDeviceInfo_v1) == 336, "the frozen copy of EpmDeviceInfo was edited");

typedef struct EpmResidencyConfig_v1 {
  size_t size;
  uint64_t budget_bytes;
  uint32_t policy;
  uint32_t register_sources;
  uint32_t prefetch_depth;
  uint32_t sync_page_in;
  uint32_t staging_slots;
  uint32_t fill_threads;
  uint64_t staging_chunk_bytes;
  uint64_t staging_pool_bytes;
  uint64_t coalesce_below_bytes;
  uint64_t coalesce_max_bytes;
} EpmResidencyConfig_v1;
_Static_assert(sizeof(EpmResidencyConfig_v1) == 72, "the frozen copy of EpmResidencyConfig was edited");

typedef struct EpmResidencyStats_v1 {
  size_t size;
  uint64_t acquires;
  uint64_t hits;
  double hit_rate;
  uint64_t page_ins;
  uint64_t prefetch_page_ins;
  uint64_t pending_prefetches;
  uint64_t wasted_prefetches;
  uint64_t evictions;
  uint64_t eviction_waits;
  uint64_t bypassed_page_ins;
  uint64_t staged_page_ins;
  uint64_t source_registrations;
  uint64_t register_refusals;
  uint64_t registered_bytes;
  uint64_t htod_bytes;
  uint64_t pinned_alloc_calls;
  uint64_t pinned_reuses;
  double fill_ms;
  double htod_ms;
  double stall_ms;
  double device_stall_ms;
  double host_stall_ms;
  uint64_t resident_bytes;
  uint64_t peak_resident_bytes;
  uint64_t resident_weights;
  uint64_t registered_weights;
  uint64_t budget_bytes;
  uint64_t arena_driver_alloc_calls;
  uint64_t arena_driver_free_calls;
  uint64_t arena_reserved_bytes;
  uint64_t arena_committed_bytes;
  uint64_t arena_in_use_bytes;
  double arena_fragmentation;
  uint64_t coalesced_weights;
  uint64_t ordered_reuses;
} EpmResidencyStats_v1;
_Static_assert(sizeof(EpmResidencyStats_v1) == 288, "the frozen copy of EpmResidencyStats was edited");

typedef struct EpmCopyEngineConfig_v1 {
  size_t size;
  uint32_t slots;
  uint32_t fill_threads;
  uint64_t chunk_bytes;
  uint32_t flags;
  uint32_t target_chunks;
} EpmCopyEngineConfig_v1;
_Static_assert(sizeof(EpmCopyEngineConfig_v1) == 32, "the frozen copy of EpmCopyEngineConfig was edited");

typedef struct EpmStagingStats_v1 {
  size_t size;
  uint64_t pinned_alloc_calls;
  uint64_t pinned_free_calls;
  uint64_t pinned_reuses;
  uint64_t retained_bytes;
  uint64_t retained_buffers;
  uint64_t copies;
  uint64_t bypassed;
  uint64_t htod_bytes;
  uint64_t chunks;
  double fill_ms;
  double slot_wait_ms;
  double htod_ms;
  uint64_t timed_copies;
} EpmStagingStats_v1;
_Static_assert(sizeof(EpmStagingStats_v1) == 112, "the frozen copy of EpmStagingStats was edited");

typedef struct EpmArenaConfig_v1 {
  size_t size;
  uint64_t capacity_bytes;
  uint64_t chunk_bytes;
  uint32_t max_allocations;
} EpmArenaConfig_v1;
_Static_assert(sizeof(EpmArenaConfig_v1) == 32, "the frozen copy of EpmArenaConfig was edited");

typedef struct EpmArenaStats_v1 {
  size_t size;
  uint64_t driver_alloc_calls;
  uint64_t driver_free_calls;
  uint64_t reserved_bytes;
  uint64_t committed_bytes;
  uint64_t in_use_bytes;
  uint64_t peak_in_use_bytes;
  uint64_t live_allocations;
  uint64_t alloc_calls;
  uint64_t free_calls;
  double fragmentation;
} EpmArenaStats_v1;
_Static_assert(sizeof(EpmArenaStats_v1) == 88, "the frozen copy of EpmArenaStats was edited");

typedef struct EpmKvLayout_v1 {
  size_t size;
  uint32_t layers;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t elem_bytes;
  uint64_t token_stride;
  uint64_t layer_stride;
  uint64_t kv_stride;
  uint64_t head_stride;
} EpmKvLayout_v1;
_Static_assert(sizeof(EpmKvLayout_v1) == 56, "the frozen copy of EpmKvLayout was edited");

typedef struct EpmKvStats_v1 {
  size_t size;
  uint64_t budget_bytes;
  uint64_t owned_bytes;
  uint64_t promised_bytes;
  uint64_t peak_owned_bytes;
  uint64_t owned_granules;
  uint64_t charges;
  uint64_t credits;
  uint64_t refusals;
  uint64_t granule_bytes;
  uint64_t pool_created;
  uint64_t pool_released;
  uint64_t pool_reused;
  uint64_t pool_retained;
  uint64_t sequences;
  uint64_t prefixes;
  uint64_t pinned_prefixes;
  uint64_t mapped_bytes;
  uint64_t cow_granules;
  uint64_t committed_granules;
  uint64_t fences;
  uint64_t hash_hits;
} EpmKvStats_v1;
_Static_assert(sizeof(EpmKvStats_v1) == 176, "the frozen copy of EpmKvStats was edited");

typedef struct EpmKvSeqInfo_v1 {
  size_t size;
  uint32_t layers;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t elem_bytes;
  uint64_t token_stride;
  uint64_t layer_stride;
  uint64_t kv_stride;
  uint64_t head_stride;
  uint64_t base;
  uint64_t max_tokens;
  uint64_t len_tokens;
  uint64_t reserved_bytes;
  uint64_t shared_granules;
  uint64_t private_granules;
  uint64_t promised_granules;
} EpmKvSeqInfo_v1;
_Static_assert(sizeof(EpmKvSeqInfo_v1) == 112, "the frozen copy of EpmKvSeqInfo was edited");

typedef struct EpmKvPrefixInfo_v1 {
  size_t size;
  uint64_t n_tokens;
  uint64_t granules;
  uint32_t sharers;
  bool pinned;
  uint64_t view_base;
} EpmKvPrefixInfo_v1;
_Static_assert(sizeof(EpmKvPrefixInfo_v1) == 40, "the frozen copy of EpmKvPrefixInfo was edited");

typedef struct EpmKvAdmission_v1 {
  size_t size;
  uint64_t without_sharing;
  uint64_t with_sharing;
  uint64_t seed_formula;
} EpmKvAdmission_v1;
_Static_assert(sizeof(EpmKvAdmission_v1) == 32, "the frozen copy of EpmKvAdmission was edited");

typedef struct EpmKvRequestCost_v1 {
  size_t size;
  uint64_t prefix_bytes;
  uint64_t private_bytes;
  uint64_t unshared_bytes;
} EpmKvRequestCost_v1;
_Static_assert(sizeof(EpmKvRequestCost_v1) == 32, "the frozen copy of EpmKvRequestCost was edited");

typedef struct EpmKvBatchDesc_v1 {
  size_t size;
  uint64_t base;
  uint64_t slot_stride;
  uint32_t max_slots;
  uint32_t layers;
  uint64_t max_tokens;
  uint64_t token_stride;
  uint64_t layer_stride;
  uint64_t kv_stride;
  uint64_t head_stride;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t elem_bytes;
  uint32_t live_slots;
  uint64_t granule_bytes;
  uint64_t reserved_bytes;
} EpmKvBatchDesc_v1;
_Static_assert(sizeof(EpmKvBatchDesc_v1) == 104, "the frozen copy of EpmKvBatchDesc was edited");

typedef struct EpmKvBatchSlotInfo_v1 {
  size_t size;
  uint64_t base;
  uint64_t len_tokens;
  uint64_t committed_tokens;
  uint64_t max_tokens;
  uint64_t shared_granules;
  uint64_t private_granules;
  uint64_t promised_granules;
  uint32_t slot;
  uint32_t max_slots;
} EpmKvBatchSlotInfo_v1;
_Static_assert(sizeof(EpmKvBatchSlotInfo_v1) == 72, "the frozen copy of EpmKvBatchSlotInfo was edited");

/* The published layout: X(struct, field) for every field of every v1 struct. */
#define EPM_V1_FIELDS_DEVICEINFO(X) \
  X(EpmDeviceInfo, size) \
  X(EpmDeviceInfo, kind) \
  X(EpmDeviceInfo, ordinal) \
  X(EpmDeviceInfo, total_memory) \
  X(EpmDeviceInfo, granularity) \
  X(EpmDeviceInfo, compute_capability_major) \
  X(EpmDeviceInfo, compute_capability_minor) \
  X(EpmDeviceInfo, driver_version) \
  X(EpmDeviceInfo, name) \
  X(EpmDeviceInfo, pci_bus_id)

#define EPM_V1_FIELDS_RESIDENCYCONFIG(X) \
  X(EpmResidencyConfig, size) \
  X(EpmResidencyConfig, budget_bytes) \
  X(EpmResidencyConfig, policy) \
  X(EpmResidencyConfig, register_sources) \
  X(EpmResidencyConfig, prefetch_depth) \
  X(EpmResidencyConfig, sync_page_in) \
  X(EpmResidencyConfig, staging_slots) \
  X(EpmResidencyConfig, fill_threads) \
  X(EpmResidencyConfig, staging_chunk_bytes) \
  X(EpmResidencyConfig, staging_pool_bytes) \
  X(EpmResidencyConfig, coalesce_below_bytes) \
  X(EpmResidencyConfig, coalesce_max_bytes)

#define EPM_V1_FIELDS_RESIDENCYSTATS(X) \
  X(EpmResidencyStats, size) \
  X(EpmResidencyStats, acquires) \
  X(EpmResidencyStats, hits) \
  X(EpmResidencyStats, hit_rate) \
  X(EpmResidencyStats, page_ins) \
  X(EpmResidencyStats, prefetch_page_ins) \
  X(EpmResidencyStats, pending_prefetches) \
  X(EpmResidencyStats, wasted_prefetches) \
  X(EpmResidencyStats, evictions) \
  X(EpmResidencyStats, eviction_waits) \
  X(EpmResidencyStats, bypassed_page_ins) \
  X(EpmResidencyStats, staged_page_ins) \
  X(EpmResidencyStats, source_registrations) \
  X(EpmResidencyStats, register_refusals) \
  X(EpmResidencyStats, registered_bytes) \
  X(EpmResidencyStats, htod_bytes) \
  X(EpmResidencyStats, pinned_alloc_calls) \
  X(EpmResidencyStats, pinned_reuses) \
  X(EpmResidencyStats, fill_ms) \
  X(EpmResidencyStats, htod_ms) \
  X(EpmResidencyStats, stall_ms) \
  X(EpmResidencyStats, device_stall_ms) \
  X(EpmResidencyStats, host_stall_ms) \
  X(EpmResidencyStats, resident_bytes) \
  X(EpmResidencyStats, peak_resident_bytes) \
  X(EpmResidencyStats, resident_weights) \
  X(EpmResidencyStats, registered_weights) \
  X(EpmResidencyStats, budget_bytes) \
  X(EpmResidencyStats, arena_driver_alloc_calls) \
  X(EpmResidencyStats, arena_driver_free_calls) \
  X(EpmResidencyStats, arena_reserved_bytes) \
  X(EpmResidencyStats, arena_committed_bytes) \
  X(EpmResidencyStats, arena_in_use_bytes) \
  X(EpmResidencyStats, arena_fragmentation) \
  X(EpmResidencyStats, coalesced_weights) \
  X(EpmResidencyStats, ordered_reuses)

#define EPM_V1_FIELDS_COPYENGINECONFIG(X) \
  X(EpmCopyEngineConfig, size) \
  X(EpmCopyEngineConfig, slots) \
  X(EpmCopyEngineConfig, fill_threads) \
  X(EpmCopyEngineConfig, chunk_bytes) \
  X(EpmCopyEngineConfig, flags) \
  X(EpmCopyEngineConfig, target_chunks)

#define EPM_V1_FIELDS_STAGINGSTATS(X) \
  X(EpmStagingStats, size) \
  X(EpmStagingStats, pinned_alloc_calls) \
  X(EpmStagingStats, pinned_free_calls) \
  X(EpmStagingStats, pinned_reuses) \
  X(EpmStagingStats, retained_bytes) \
  X(EpmStagingStats, retained_buffers) \
  X(EpmStagingStats, copies) \
  X(EpmStagingStats, bypassed) \
  X(EpmStagingStats, htod_bytes) \
  X(EpmStagingStats, chunks) \
  X(EpmStagingStats, fill_ms) \
  X(EpmStagingStats, slot_wait_ms) \
  X(EpmStagingStats, htod_ms) \
  X(EpmStagingStats, timed_copies)

#define EPM_V1_FIELDS_ARENACONFIG(X) \
  X(EpmArenaConfig, size) \
  X(EpmArenaConfig, capacity_bytes) \
  X(EpmArenaConfig, chunk_bytes) \
  X(EpmArenaConfig, max_allocations)

#define EPM_V1_FIELDS_ARENASTATS(X) \
  X(EpmArenaStats, size) \
  X(EpmArenaStats, driver_alloc_calls) \
  X(EpmArenaStats, driver_free_calls) \
  X(EpmArenaStats, reserved_bytes) \
  X(EpmArenaStats, committed_bytes) \
  X(EpmArenaStats, in_use_bytes) \
  X(EpmArenaStats, peak_in_use_bytes) \
  X(EpmArenaStats, live_allocations) \
  X(EpmArenaStats, alloc_calls) \
  X(EpmArenaStats, free_calls) \
  X(EpmArenaStats, fragmentation)

#define EPM_V1_FIELDS_KVLAYOUT(X) \
  X(EpmKvLayout, size) \
  X(EpmKvLayout, layers) \
  X(EpmKvLayout, kv_heads) \
  X(EpmKvLayout, head_dim) \
  X(EpmKvLayout, elem_bytes) \
  X(EpmKvLayout, token_stride) \
  X(EpmKvLayout, layer_stride) \
  X(EpmKvLayout, kv_stride) \
  X(EpmKvLayout, head_stride)

#define EPM_V1_FIELDS_KVSTATS(X) \
  X(EpmKvStats, size) \
  X(EpmKvStats, budget_bytes) \
  X(EpmKvStats, owned_bytes) \
  X(EpmKvStats, promised_bytes) \
  X(EpmKvStats, peak_owned_bytes) \
  X(EpmKvStats, owned_granules) \
  X(EpmKvStats, charges) \
  X(EpmKvStats, credits) \
  X(EpmKvStats, refusals) \
  X(EpmKvStats, granule_bytes) \
  X(EpmKvStats, pool_created) \
  X(EpmKvStats, pool_released) \
  X(EpmKvStats, pool_reused) \
  X(EpmKvStats, pool_retained) \
  X(EpmKvStats, sequences) \
  X(EpmKvStats, prefixes) \
  X(EpmKvStats, pinned_prefixes) \
  X(EpmKvStats, mapped_bytes) \
  X(EpmKvStats, cow_granules) \
  X(EpmKvStats, committed_granules) \
  X(EpmKvStats, fences) \
  X(EpmKvStats, hash_hits)

#define EPM_V1_FIELDS_KVSEQINFO(X) \
  X(EpmKvSeqInfo, size) \
  X(EpmKvSeqInfo, layers) \
  X(EpmKvSeqInfo, kv_heads) \
  X(EpmKvSeqInfo, head_dim) \
  X(EpmKvSeqInfo, elem_bytes) \
  X(EpmKvSeqInfo, token_stride) \
  X(EpmKvSeqInfo, layer_stride) \
  X(EpmKvSeqInfo, kv_stride) \
  X(EpmKvSeqInfo, head_stride) \
  X(EpmKvSeqInfo, base) \
  X(EpmKvSeqInfo, max_tokens) \
  X(EpmKvSeqInfo, len_tokens) \
  X(EpmKvSeqInfo, reserved_bytes) \
  X(EpmKvSeqInfo, shared_granules) \
  X(EpmKvSeqInfo, private_granules) \
  X(EpmKvSeqInfo, promised_granules)

#define EPM_V1_FIELDS_KVPREFIXINFO(X) \
  X(EpmKvPrefixInfo, size) \
  X(EpmKvPrefixInfo, n_tokens) \
  X(EpmKvPrefixInfo, granules) \
  X(EpmKvPrefixInfo, sharers) \
  X(EpmKvPrefixInfo, pinned) \
  X(EpmKvPrefixInfo, view_base)

#define EPM_V1_FIELDS_KVADMISSION(X) \
  X(EpmKvAdmission, size) \
  X(EpmKvAdmission, without_sharing) \
  X(EpmKvAdmission, with_sharing) \
  X(EpmKvAdmission, seed_formula)

#define EPM_V1_FIELDS_KVREQUESTCOST(X) \
  X(EpmKvRequestCost, size) \
  X(EpmKvRequestCost, prefix_bytes) \
  X(EpmKvRequestCost, private_bytes) \
  X(EpmKvRequestCost, unshared_bytes)

#define EPM_V1_FIELDS_KVBATCHDESC(X) \
  X(EpmKvBatchDesc, size) \
  X(EpmKvBatchDesc, base) \
  X(EpmKvBatchDesc, slot_stride) \
  X(EpmKvBatchDesc, max_slots) \
  X(EpmKvBatchDesc, layers) \
  X(EpmKvBatchDesc, max_tokens) \
  X(EpmKvBatchDesc, token_stride) \
  X(EpmKvBatchDesc, layer_stride) \
  X(EpmKvBatchDesc, kv_stride) \
  X(EpmKvBatchDesc, head_stride) \
  X(EpmKvBatchDesc, kv_heads) \
  X(EpmKvBatchDesc, head_dim) \
  X(EpmKvBatchDesc, elem_bytes) \
  X(EpmKvBatchDesc, live_slots) \
  X(EpmKvBatchDesc, granule_bytes) \
  X(EpmKvBatchDesc, reserved_bytes)

#define EPM_V1_FIELDS_KVBATCHSLOTINFO(X) \
  X(EpmKvBatchSlotInfo, size) \
  X(EpmKvBatchSlotInfo, base) \
  X(EpmKvBatchSlotInfo, len_tokens) \
  X(EpmKvBatchSlotInfo, committed_tokens) \
  X(EpmKvBatchSlotInfo, max_tokens) \
  X(EpmKvBatchSlotInfo, shared_granules) \
  X(EpmKvBatchSlotInfo, private_granules) \
  X(EpmKvBatchSlotInfo, promised_granules) \
  X(EpmKvBatchSlotInfo, slot) \
  X(EpmKvBatchSlotInfo, max_slots)

/* X(struct, EPM_*_SIZE_V1) for every versioned struct. */
#define EPM_V1_STRUCTS(X) \
  X(EpmDeviceInfo, EPM_DEVICE_INFO_SIZE_V1) \
  X(EpmResidencyConfig, EPM_RESIDENCY_CONFIG_SIZE_V1) \
  X(EpmResidencyStats, EPM_RESIDENCY_STATS_SIZE_V1) \
  X(EpmCopyEngineConfig, EPM_COPY_ENGINE_CONFIG_SIZE_V1) \
  X(EpmStagingStats, EPM_STAGING_STATS_SIZE_V1) \
  X(EpmArenaConfig, EPM_ARENA_CONFIG_SIZE_V1) \
  X(EpmArenaStats, EPM_ARENA_STATS_SIZE_V1) \
  X(EpmKvLayout, EPM_KV_LAYOUT_SIZE_V1) \
  X(EpmKvStats, EPM_KV_STATS_SIZE_V1) \
  X(EpmKvSeqInfo, EPM_KV_SEQ_INFO_SIZE_V1) \
  X(EpmKvPrefixInfo, EPM_KV_PREFIX_INFO_SIZE_V1) \
  X(EpmKvAdmission, EPM_KV_ADMISSION_SIZE_V1) \
  X(EpmKvRequestCost, EPM_KV_REQUEST_COST_SIZE_V1) \
  X(EpmKvBatchDesc, EPM_KV_BATCH_DESC_SIZE_V1) \
  X(EpmKvBatchSlotInfo, EPM_KV_BATCH_SLOT_INFO_SIZE_V1)

#define EPM_V1_ALL_FIELDS(X) \
  EPM_V1_FIELDS_DEVICEINFO(X) \
  EPM_V1_FIELDS_RESIDENCYCONFIG(X) \
  EPM_V1_FIELDS_RESIDENCYSTATS(X) \
  EPM_V1_FIELDS_COPYENGINECONFIG(X) \
  EPM_V1_FIELDS_STAGINGSTATS(X) \
  EPM_V1_FIELDS_ARENACONFIG(X) \
  EPM_V1_FIELDS_ARENASTATS(X) \
  EPM_V1_FIELDS_KVLAYOUT(X) \
  EPM_V1_FIELDS_KVSTATS(X) \
  EPM_V1_FIELDS_KVSEQINFO(X) \
  EPM_V1_FIELDS_KVPREFIXINFO(X) \
  EPM_V1_FIELDS_KVADMISSION(X) \
  EPM_V1_FIELDS_KVREQUESTCOST(X) \
  EPM_V1_FIELDS_KVBATCHDESC(X) \
  EPM_V1_FIELDS_KVBATCHSLOTINFO(X)

#endif /* EPMEM_ABI_V1_STRUCTS_H */
