use epmem::device::*;
#[test]
fn smoke() {
    let d = open(DeviceSelect::Host, 0).unwrap();
    let s = Stream::new(&d).unwrap();
    let b = DeviceBuffer::new(&d, 4096).unwrap();
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    unsafe { d.memcpy_htod_async(b.ptr(), src.as_ptr(), 4096, s.raw()).unwrap() };
    unsafe { d.memcpy_dtoh_async(dst.as_mut_ptr(), b.ptr(), 4096, s.raw()).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(src, dst);
    let g = d.vmm_granularity();
    let ph = PhysMem::new(&d, g).unwrap();
    let mut r = VaRange::reserve(&d, 2 * g).unwrap();
    r.map(0, g, &ph, 0, Access::ReadWrite).unwrap();
    r.map(g, g, &ph, 0, Access::ReadOnly).unwrap();
    unsafe { d.memcpy_htod_async(r.base(), src.as_ptr(), 4096, s.raw()).unwrap() };
    let e = unsafe { d.memcpy_htod_async(r.base() + g as u64, src.as_ptr(), 4096, s.raw()) }.unwrap_err();
    assert_eq!(e.status(), epmem::EpmStatus::AccessDenied, "{e}");
    dst.fill(0);
    unsafe { d.memcpy_dtoh_async(dst.as_mut_ptr(), r.base() + g as u64, 4096, s.raw()).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(src, dst);
}
