//! The EP's GEMM on the host device: Y = alpha · X · op(W) + beta · bias,
//! row-major, computed in f32 by `matrixmultiply` (float16 and bfloat16 are
//! widened to f32 first and the result rounded back to nearest even, so the
//! accumulation is f32 as on the GPU path).

use half::{bf16, f16};

use super::abi::*;

/// Element bytes → f32.
pub(crate) fn to_f32(elem: ONNXTensorElementDataType, bytes: &[u8]) -> Vec<f32> {
    match elem {
        TENSOR_ELEMENT_FLOAT16 => {
            bytes.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
        }
        TENSOR_ELEMENT_BFLOAT16 => {
            bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
        }
        _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    }
}

/// f32 → element bytes (round to nearest even for the 16-bit types).
pub(crate) fn from_f32(elem: ONNXTensorElementDataType, v: &[f32]) -> Vec<u8> {
    match elem {
        TENSOR_ELEMENT_FLOAT16 => v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        TENSOR_ELEMENT_BFLOAT16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// The shape of one GEMM.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// W is stored [n, k] instead of [k, n].
    pub trans_b: bool,
    pub alpha: f32,
    pub beta: f32,
}

/// Y[m, n] (element bytes) from X[m, k] and W (element bytes), with an
/// optional bias row of n values (f32) added times beta.
pub(crate) fn gemm(elem: ONNXTensorElementDataType, s: GemmShape, x: &[u8], w: &[u8], bias: Option<&[f32]>) -> Vec<u8> {
    let xf = to_f32(elem, x);
    let wf = to_f32(elem, w);
    debug_assert_eq!(xf.len(), s.m * s.k);
    debug_assert_eq!(wf.len(), s.k * s.n);
    let mut y = vec![0f32; s.m * s.n];
    let beta = match bias {
        Some(b) if s.beta != 0.0 => {
            for row in y.chunks_exact_mut(s.n) {
                row.copy_from_slice(b);
            }
            s.beta
        }
        _ => 0.0,
    };
    // Strides of W as a [k, n] operand.
    let (rsb, csb) = if s.trans_b { (1, s.k as isize) } else { (s.n as isize, 1) };
    // SAFETY: every pointer covers the extent its dimensions and strides
    // address (asserted above in debug builds, by construction otherwise):
    // x is m×k row-major, w is k×n with the strides above, y is m×n.
    unsafe {
        matrixmultiply::sgemm(
            s.m,
            s.k,
            s.n,
            s.alpha,
            xf.as_ptr(),
            s.k as isize,
            1,
            wf.as_ptr(),
            rsb,
            csb,
            beta,
            y.as_mut_ptr(),
            s.n as isize,
            1,
        );
    }
    from_f32(elem, &y)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(s: GemmShape, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
        let mut y = vec![0f32; s.m * s.n];
        for i in 0..s.m {
            for j in 0..s.n {
                let mut acc = 0f64;
                for p in 0..s.k {
                    let wv = if s.trans_b { w[j * s.k + p] } else { w[p * s.n + j] };
                    acc += x[i * s.k + p] as f64 * wv as f64;
                }
                y[i * s.n + j] = s.alpha * acc as f32 + bias.map_or(0.0, |b| s.beta * b[j]);
            }
        }
        y
    }

    #[test]
    fn matches_a_naive_product_for_every_layout_and_type() {
        let mut rng = fastrand::Rng::with_seed(7);
        for &(m, k, n) in &[(1, 3, 5), (7, 64, 33), (4, 128, 1)] {
            for trans_b in [false, true] {
                for elem in [TENSOR_ELEMENT_FLOAT, TENSOR_ELEMENT_FLOAT16, TENSOR_ELEMENT_BFLOAT16] {
                    let s = GemmShape { m, k, n, trans_b, alpha: 0.75, beta: 1.5 };
                    // Values exactly representable in every type: small multiples of 1/8.
                    let x: Vec<f32> = (0..m * k).map(|_| rng.i32(-8..8) as f32 / 8.0).collect();
                    let w: Vec<f32> = (0..k * n).map(|_| rng.i32(-8..8) as f32 / 8.0).collect();
                    let b: Vec<f32> = (0..n).map(|_| rng.i32(-8..8) as f32 / 8.0).collect();
                    let got = to_f32(elem, &gemm(elem, s, &from_f32(elem, &x), &from_f32(elem, &w), Some(&b)));
                    let want = naive(s, &x, &w, Some(&b));
                    // The sums are exact in f32; the 16-bit outputs round once.
                    let tol = if elem == TENSOR_ELEMENT_FLOAT { 1e-5 } else { 1.0 / 64.0 };
                    for (g, e) in got.iter().zip(&want) {
                        assert!(
                            (g - e).abs() <= tol * e.abs().max(1.0),
                            "{m}x{k}x{n} t={trans_b} e={elem}: {g} vs {e}"
                        );
                    }
                    let plain = to_f32(
                        elem,
                        &gemm(elem, GemmShape { beta: 0.0, ..s }, &from_f32(elem, &x), &from_f32(elem, &w), Some(&b)),
                    );
                    let want0 = naive(GemmShape { beta: 0.0, ..s }, &x, &w, None);
                    assert!(plain.iter().zip(&want0).all(|(g, e)| (g - e).abs() <= tol * e.abs().max(1.0)));
                }
            }
        }
    }
}
