//! Run-time choice of the SIMD instruction set.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 with BF16 dot products (`vdpbf16ps`): bf16 matrix products take bf16
    /// activations and do 32 multiply-adds per instruction; everything else as `Avx512`.
    Avx512Bf16,
    /// AVX-512 F/BW/VL: 16 f32 lanes, masked tails.
    Avx512,
    /// AVX2 + FMA + F16C: 8 f32 lanes.
    Avx2,
    /// Portable Rust.
    Scalar,
}

impl Isa {
    /// Every ISA this CPU can run, best first.
    pub fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                if is_x86_feature_detected!("avx512bf16") {
                    v.push(Isa::Avx512Bf16);
                }
                v.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Scalar);
        v
    }

    /// The best available ISA, or the one `THAW_ISA` (avx512bf16|avx512|avx2|scalar) names if
    /// the CPU has it.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let avail = Isa::available();
            let wanted = std::env::var("THAW_ISA")
                .ok()
                .and_then(|s| match s.as_str() {
                    "avx512bf16" => Some(Isa::Avx512Bf16),
                    "avx512" => Some(Isa::Avx512),
                    "avx2" => Some(Isa::Avx2),
                    "scalar" => Some(Isa::Scalar),
                    _ => None,
                });
            match wanted {
                Some(w) if avail.contains(&w) => w,
                _ => avail[0],
            }
        })
    }

    /// Whether the AVX-512 f32 paths apply (everything but the bf16 matrix product).
    pub fn avx512(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx512Bf16)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        }
    }
}
