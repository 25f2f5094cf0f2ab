//! Reading ORT's graph, node, value-info and kernel-context objects (the
//! `OrtApi` calls of the compute path) into owned Rust values.
//!
//! Every string and array is copied out: ORT's graph objects are valid only
//! during the call that hands them to us (`GetCapability`, `Compile`).

use std::ffi::{CStr, c_char, c_void};

use super::abi::*;
use super::api::Api;
use crate::error::Result;

/// A tensor's element type and dimensions (-1 where a dimension is symbolic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorType {
    pub elem: ONNXTensorElementDataType,
    pub dims: Vec<i64>,
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn owned(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: per the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Api {
    /// The nodes of a graph, in ORT's (topological) order.
    ///
    /// # Safety
    /// `g` is a live `OrtGraph`.
    pub unsafe fn graph_nodes(&self, g: *const OrtGraph) -> Result<Vec<*const OrtNode>> {
        let mut n = 0usize;
        // SAFETY: per the caller; out-pointers are valid.
        unsafe {
            self.check((self.o.Graph_GetNumNodes)(g, &mut n), "Graph_GetNumNodes")?;
            let mut v = vec![std::ptr::null::<OrtNode>(); n];
            self.check((self.o.Graph_GetNodes)(g, v.as_mut_ptr(), n), "Graph_GetNodes")?;
            Ok(v)
        }
    }

    /// A node's name, operator type and domain ("" is the ONNX domain).
    ///
    /// # Safety
    /// `node` is a live `OrtNode`.
    pub unsafe fn node_ident(&self, node: *const OrtNode) -> Result<(String, String, String)> {
        let (mut name, mut op, mut domain) = (std::ptr::null(), std::ptr::null(), std::ptr::null());
        // SAFETY: per the caller; ORT's strings live as long as the node.
        unsafe {
            self.check((self.o.Node_GetName)(node, &mut name), "Node_GetName")?;
            self.check((self.o.Node_GetOperatorType)(node, &mut op), "Node_GetOperatorType")?;
            self.check((self.o.Node_GetDomain)(node, &mut domain), "Node_GetDomain")?;
            Ok((owned(name), owned(op), owned(domain)))
        }
    }

    /// A node's inputs (NULL where an optional input is absent).
    ///
    /// # Safety
    /// `node` is a live `OrtNode`.
    pub unsafe fn node_inputs(&self, node: *const OrtNode) -> Result<Vec<*const OrtValueInfo>> {
        let mut n = 0usize;
        // SAFETY: per the caller; out-pointers are valid.
        unsafe {
            self.check((self.o.Node_GetNumInputs)(node, &mut n), "Node_GetNumInputs")?;
            let mut v = vec![std::ptr::null::<OrtValueInfo>(); n];
            self.check((self.o.Node_GetInputs)(node, v.as_mut_ptr(), n), "Node_GetInputs")?;
            Ok(v)
        }
    }

    /// A node's outputs.
    ///
    /// # Safety
    /// `node` is a live `OrtNode`.
    pub unsafe fn node_outputs(&self, node: *const OrtNode) -> Result<Vec<*const OrtValueInfo>> {
        let mut n = 0usize;
        // SAFETY: per the caller; out-pointers are valid.
        unsafe {
            self.check((self.o.Node_GetNumOutputs)(node, &mut n), "Node_GetNumOutputs")?;
            let mut v = vec![std::ptr::null::<OrtValueInfo>(); n];
            self.check((self.o.Node_GetOutputs)(node, v.as_mut_ptr(), n), "Node_GetOutputs")?;
            Ok(v)
        }
    }

    /// An attribute of a node, or None when the node does not set it. ORT
    /// versions differ in how they report a missing attribute (a NULL
    /// attribute, or an error status): both mean "not set".
    ///
    /// # Safety
    /// `node` is a live `OrtNode`.
    unsafe fn node_attr(&self, node: *const OrtNode, name: &str) -> Option<*const OrtOpAttr> {
        let k = super::api::cstring_lossy(name);
        let mut a: *const OrtOpAttr = std::ptr::null();
        // SAFETY: per the caller; a status we get back is ours to release.
        unsafe {
            let st = (self.o.Node_GetAttributeByName)(node, k.as_ptr(), &mut a);
            if !st.is_null() {
                (self.o.ReleaseStatus)(st);
                return None;
            }
        }
        (!a.is_null()).then_some(a)
    }

    /// An integer attribute (None when not set).
    ///
    /// # Safety
    /// `node` is a live `OrtNode`.
    pub unsafe fn node_attr_int(&self, node: *const OrtNode, name: &str) -> Result<Option<i64>> {
        // SAFETY: per the caller.
        let Some(a) = (unsafe { self.node_attr(node, name) }) else {
            return Ok(None);
        };
        let (mut v, mut len) = (0i64, 0usize);
        // SAFETY: `a` is live while the node is; the buffer holds one int64.
        let st = unsafe { (self.o.ReadOpAttr)(a, OP_ATTR_INT, &mut v as *mut i64 as *mut c_void, 8, &mut len) };
        self.check(st, &format!("ReadOpAttr({name})"))?;
        Ok(Some(v))
    }

    /// A float attribute (None when not set).
    ///
    /// # Safety
    /// `node` is a live `OrtNode`.
    pub unsafe fn node_attr_float(&self, node: *const OrtNode, name: &str) -> Result<Option<f32>> {
        // SAFETY: per the caller.
        let Some(a) = (unsafe { self.node_attr(node, name) }) else {
            return Ok(None);
        };
        let (mut v, mut len) = (0f32, 0usize);
        // SAFETY: `a` is live while the node is; the buffer holds one float.
        let st = unsafe { (self.o.ReadOpAttr)(a, OP_ATTR_FLOAT, &mut v as *mut f32 as *mut c_void, 4, &mut len) };
        self.check(st, &format!("ReadOpAttr({name})"))?;
        Ok(Some(v))
    }

    /// A value's name.
    ///
    /// # Safety
    /// `vi` is a live `OrtValueInfo`.
    pub unsafe fn value_name(&self, vi: *const OrtValueInfo) -> Result<String> {
        let mut p = std::ptr::null();
        // SAFETY: per the caller.
        unsafe {
            self.check((self.o.GetValueInfoName)(vi, &mut p), "GetValueInfoName")?;
            Ok(owned(p))
        }
    }

    /// A value's tensor type, or None when it is not a tensor.
    ///
    /// # Safety
    /// `vi` is a live `OrtValueInfo`.
    pub unsafe fn value_type(&self, vi: *const OrtValueInfo) -> Result<Option<TensorType>> {
        let mut ti: *const OrtTypeInfo = std::ptr::null();
        // SAFETY: per the caller; the type info belongs to the value info.
        unsafe {
            self.check((self.o.GetValueInfoTypeInfo)(vi, &mut ti), "GetValueInfoTypeInfo")?;
            if ti.is_null() {
                return Ok(None);
            }
            let mut info: *const OrtTensorTypeAndShapeInfo = std::ptr::null();
            self.check((self.o.CastTypeInfoToTensorInfo)(ti, &mut info), "CastTypeInfoToTensorInfo")?;
            if info.is_null() {
                return Ok(None);
            }
            self.tensor_type(info).map(Some)
        }
    }

    /// # Safety
    /// `info` is a live `OrtTensorTypeAndShapeInfo`.
    unsafe fn tensor_type(&self, info: *const OrtTensorTypeAndShapeInfo) -> Result<TensorType> {
        let (mut elem, mut n) = (0, 0usize);
        // SAFETY: per the caller; the dims buffer has room for n values.
        unsafe {
            self.check((self.o.GetTensorElementType)(info, &mut elem), "GetTensorElementType")?;
            self.check((self.o.GetDimensionsCount)(info, &mut n), "GetDimensionsCount")?;
            let mut dims = vec![0i64; n];
            self.check((self.o.GetDimensions)(info, dims.as_mut_ptr(), n), "GetDimensions")?;
            Ok(TensorType { elem, dims })
        }
    }

    /// The element type and shape of a tensor value.
    ///
    /// # Safety
    /// `v` is a live `OrtValue`.
    pub unsafe fn value_tensor_type(&self, v: *const OrtValue) -> Result<TensorType> {
        let mut info: *mut OrtTensorTypeAndShapeInfo = std::ptr::null_mut();
        // SAFETY: per the caller; we own and release `info`.
        unsafe {
            self.check((self.o.GetTensorTypeAndShape)(v, &mut info), "GetTensorTypeAndShape")?;
            let r = self.tensor_type(info);
            (self.o.ReleaseTensorTypeAndShapeInfo)(info);
            r
        }
    }

    /// Whether a value is a constant initializer (not overridable by a feed).
    ///
    /// # Safety
    /// `vi` is a live `OrtValueInfo`.
    pub unsafe fn is_constant_initializer(&self, vi: *const OrtValueInfo) -> Result<bool> {
        let mut b = false;
        // SAFETY: per the caller.
        let st = unsafe { (self.o.ValueInfo_IsConstantInitializer)(vi, &mut b) };
        self.check(st, "ValueInfo_IsConstantInitializer")?;
        Ok(b)
    }

    /// The data of an initializer: valid only during the call that handed
    /// us the graph (copy it out).
    ///
    /// # Safety
    /// `vi` is a live `OrtValueInfo` of an initializer.
    pub unsafe fn initializer_value(&self, vi: *const OrtValueInfo) -> Result<*const OrtValue> {
        let mut v: *const OrtValue = std::ptr::null();
        // SAFETY: per the caller.
        let st = unsafe { (self.o.ValueInfo_GetInitializerValue)(vi, &mut v) };
        self.check(st, "ValueInfo_GetInitializerValue")?;
        crate::ensure!(!v.is_null(), Internal, "ValueInfo_GetInitializerValue returned no value");
        Ok(v)
    }

    /// Every session config entry (ORT's `ep.<name>.<key>` EP options among them).
    ///
    /// # Safety
    /// `so` is NULL or a live `OrtSessionOptions`.
    pub unsafe fn session_config_entries(&self, so: *const OrtSessionOptions) -> Result<Vec<(String, String)>> {
        if so.is_null() {
            return Ok(Vec::new());
        }
        let mut kv: *mut OrtKeyValuePairs = std::ptr::null_mut();
        // SAFETY: per the caller; we own and release `kv`.
        unsafe {
            self.check((self.o.GetSessionOptionsConfigEntries)(so, &mut kv), "GetSessionOptionsConfigEntries")?;
            let entries = self.kvp_entries(kv);
            (self.o.ReleaseKeyValuePairs)(kv);
            Ok(entries)
        }
    }

    /// Input `i` of a kernel context (None when absent).
    ///
    /// # Safety
    /// `ctx` is the live `OrtKernelContext` of a `Compute` call.
    pub unsafe fn kernel_input(&self, ctx: *const OrtKernelContext, i: usize) -> Result<Option<*const OrtValue>> {
        let mut v: *const OrtValue = std::ptr::null();
        // SAFETY: per the caller.
        let st = unsafe { (self.o.KernelContext_GetInput)(ctx, i, &mut v) };
        self.check(st, "KernelContext_GetInput")?;
        Ok((!v.is_null()).then_some(v))
    }

    /// The number of inputs of a kernel context.
    ///
    /// # Safety
    /// `ctx` is the live `OrtKernelContext` of a `Compute` call.
    pub unsafe fn kernel_input_count(&self, ctx: *const OrtKernelContext) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: per the caller.
        let st = unsafe { (self.o.KernelContext_GetInputCount)(ctx, &mut n) };
        self.check(st, "KernelContext_GetInputCount")?;
        Ok(n)
    }

    /// Output `i` of a kernel context, allocated by ORT with shape `dims`.
    ///
    /// # Safety
    /// `ctx` is the live `OrtKernelContext` of a `Compute` call.
    pub unsafe fn kernel_output(&self, ctx: *mut OrtKernelContext, i: usize, dims: &[i64]) -> Result<*mut OrtValue> {
        let mut v: *mut OrtValue = std::ptr::null_mut();
        // SAFETY: per the caller; ORT copies the dims.
        let st = unsafe { (self.o.KernelContext_GetOutput)(ctx, i, dims.as_ptr(), dims.len(), &mut v) };
        self.check(st, "KernelContext_GetOutput")?;
        crate::ensure!(!v.is_null(), Internal, "KernelContext_GetOutput returned no value");
        Ok(v)
    }

    /// The native GPU stream ORT runs this node on (`cudaStream_t`), or None
    /// when ORT gives the node no stream.
    ///
    /// # Safety
    /// `ctx` is the live `OrtKernelContext` of a `Compute` call.
    pub unsafe fn kernel_gpu_stream(&self, ctx: *const OrtKernelContext) -> Result<Option<u64>> {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: per the caller.
        let st = unsafe { (self.o.KernelContext_GetGPUComputeStream)(ctx, &mut s) };
        self.check(st, "KernelContext_GetGPUComputeStream")?;
        Ok((!s.is_null()).then_some(s as u64))
    }
}

/// Bytes per element of the types the EP computes with.
pub(crate) fn elem_bytes(elem: ONNXTensorElementDataType) -> Option<usize> {
    match elem {
        TENSOR_ELEMENT_FLOAT => Some(4),
        TENSOR_ELEMENT_FLOAT16 | TENSOR_ELEMENT_BFLOAT16 => Some(2),
        _ => None,
    }
}

/// A readable name for an element type.
pub(crate) fn elem_name(elem: ONNXTensorElementDataType) -> String {
    match elem {
        TENSOR_ELEMENT_FLOAT => "float32".into(),
        TENSOR_ELEMENT_FLOAT16 => "float16".into(),
        TENSOR_ELEMENT_BFLOAT16 => "bfloat16".into(),
        2 => "uint8".into(),
        3 => "int8".into(),
        6 => "int32".into(),
        7 => "int64".into(),
        11 => "float64".into(),
        e => format!("element type {e}"),
    }
}
