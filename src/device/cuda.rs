//! STUB: replaced by the real implementation.
use super::*;

#[derive(Debug)]
pub struct CudaDevice {
    info: DeviceInfo,
}

impl CudaDevice {
    pub fn new(_ordinal: u32) -> Result<Self> {
        Err(Error::new(EpmStatus::DeviceUnavailable, "cuda device not implemented yet"))
    }
}

impl Device for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn mem_get_info(&self) -> Result<(u64, u64)> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn synchronize(&self) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn live_counts(&self) -> LiveCounts {
        Default::default()
    }
    fn driver_counts(&self) -> DriverCounts {
        Default::default()
    }
    fn stream_create(&self) -> Result<RawStream> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn stream_wrap_native(&self, _native: u64) -> Result<RawStream> {
        Err(Error::unsupported("stub"))
    }
    fn stream_native(&self, _s: RawStream) -> Result<u64> {
        Err(Error::unsupported("stub"))
    }
    fn stream_destroy(&self, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn stream_synchronize(&self, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn stream_wait_event(&self, _s: RawStream, _e: RawEvent) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn event_create(&self, _timing: bool) -> Result<RawEvent> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn event_destroy(&self, _e: RawEvent) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn event_record(&self, _e: RawEvent, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn event_query(&self, _e: RawEvent) -> Result<bool> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn event_synchronize(&self, _e: RawEvent) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn event_elapsed_ms(&self, _start: RawEvent, _end: RawEvent) -> Result<f32> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn pinned_alloc(&self, _bytes: usize) -> Result<*mut u8> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    unsafe fn pinned_free(&self, _p: *mut u8) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    unsafe fn host_register(&self, _p: *mut u8, _len: usize, _read_only: bool) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    unsafe fn host_unregister(&self, _p: *mut u8) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn host_is_page_locked(&self, _p: *const u8, _len: usize) -> bool {
        false
    }
    fn mem_alloc(&self, _bytes: usize) -> Result<DevicePtr> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn mem_free(&self, _p: DevicePtr) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    unsafe fn memcpy_htod_async(&self, _dst: DevicePtr, _src: *const u8, _n: usize, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    unsafe fn memcpy_dtoh_async(&self, _dst: *mut u8, _src: DevicePtr, _n: usize, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn memcpy_dtod_async(&self, _dst: DevicePtr, _src: DevicePtr, _n: usize, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn memset_d8_async(&self, _dst: DevicePtr, _value: u8, _n: usize, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn checksum_async(&self, _p: DevicePtr, _n: usize, _out: DevicePtr, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn spin_async(&self, _micros: u32, _s: RawStream) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_granularity(&self) -> usize {
        self.info.granularity
    }
    fn vmm_create(&self, _bytes: usize) -> Result<RawPhys> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_release(&self, _h: RawPhys) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_reserve(&self, _bytes: usize, _align: usize) -> Result<DevicePtr> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_free_va(&self, _va: DevicePtr, _bytes: usize) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_map(&self, _va: DevicePtr, _bytes: usize, _h: RawPhys, _offset: usize) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_unmap(&self, _va: DevicePtr, _bytes: usize) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
    fn vmm_set_access(&self, _va: DevicePtr, _bytes: usize, _access: Access) -> Result<()> {
        Err(Error::unsupported("cuda device not implemented yet"))
    }
}
