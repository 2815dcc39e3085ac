//! One step of the device model: the plan uploaded, the step's kernels queued (or a recording
//! of them replayed, `graphs.rs`), the result downloaded.

use std::sync::atomic::Ordering;

use thaw_kernels::device::{
    DeviceBuf, DeviceOps, Elem, GemvIn, GemvNorm, GemvOut, Paging, Tiles, GEMV_MAX_OUTS,
};

use super::graphs::{GraphKey, Replayed, StepShape};
use super::{dev_err, DeviceKv, DeviceLlama, Mat, Scratch};
use crate::model::SeqChunk;
use crate::step::{validate, StepPlan};
use crate::RuntimeError;

/// What a step brings back from the device.
pub(super) enum Step {
    Logits(Vec<f32>),
    Ids(Vec<u32>),
}

impl<D: DeviceOps> DeviceLlama<D> {
    /// One step; with `greedy`, the logits stay on the device and only each sequence's argmax
    /// id comes back. A decode step (one token per sequence) with graphs on replays the
    /// recording of its batch shape (`graphs.rs`), recording it first if there is none.
    pub(super) fn run(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut DeviceKv<D::Buf>,
        greedy: bool,
        all_rows: &[bool],
    ) -> Result<Step, RuntimeError> {
        let c = &self.cfg;
        validate(c, seqs, kv.layout.block_size, kv.layout.blocks)?;
        let plan = StepPlan::build(seqs, kv.layout, &self.inv_freq, all_rows);
        let (n, p) = (plan.rows(), plan.picked.len());
        let (meta, at) = plan.pack();
        let tiled = !plan.tile_row0.is_empty() && self.tiled_prefill.load(Ordering::Relaxed);
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = self.scratch(&mut guard, n, p, meta.len())?;
        let g = &*self.dev;
        g.bind().map_err(dev_err)?;
        g.upload(&mut s.meta, 0, &meta).map_err(dev_err)?;
        // The per-row attention kernel's rows (decodes, or every row), split where too few.
        let split = if tiled {
            let rows = plan.decode_rows.iter().map(|&r| r as usize);
            self.split(rows, &plan.pos, s.partials.ptr())
        } else {
            self.split(0..n, &plan.pos, s.partials.ptr())
        };
        let shape = StepShape {
            n,
            p,
            at,
            tiled,
            n_decode: plan.decode_rows.len(),
            n_tiles: plan.tile_row0.len(),
            split,
            greedy,
            gemv_rows: self.gemv_max_rows.load(Ordering::Relaxed),
            fuse_norm: self.fused_norm.load(Ordering::Relaxed),
        };
        let decode_only = n == seqs.len();
        let launches = if decode_only && self.use_graphs.load(Ordering::Relaxed) {
            let key = GraphKey {
                shape,
                kv: (
                    kv.k.ptr(),
                    kv.v.ptr(),
                    kv.layout.block_size,
                    kv.layout.block_stride(),
                ),
            };
            let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            match graphs.run(g, key, || self.enqueue(s, kv, &shape))? {
                Replayed::Ran(launches) => launches,
                Replayed::Refused(why) => {
                    // An optimization the device will not do fails no request: steps are
                    // queued launch by launch from now on.
                    self.use_graphs.store(false, Ordering::Relaxed);
                    graphs.clear();
                    crate::server::log(format_args!(
                        "CUDA graphs off: the device refused to record a decode step ({why})"
                    ));
                    self.enqueue(s, kv, &shape)?
                }
            }
        } else {
            self.enqueue(s, kv, &shape)?
        };
        self.gemv_launches.fetch_add(launches, Ordering::Relaxed);
        if greedy {
            return Ok(Step::Ids(download::<D, u32>(g, &s.ids, p)?));
        }
        Ok(Step::Logits(download::<D, f32>(
            g,
            &s.logits,
            p * c.vocab_size,
        )?))
    }

    /// Queues a step's work (everything between the plan's upload and the download of its
    /// result) with the arguments `shape` fixes; returns the matrix-vector launches it made.
    fn enqueue(
        &self,
        s: &Scratch<D::Buf>,
        kv: &DeviceKv<D::Buf>,
        shape: &StepShape,
    ) -> Result<u64, RuntimeError> {
        let c = &self.cfg;
        let g = &*self.dev;
        let StepShape {
            n,
            p,
            at,
            tiled,
            n_decode,
            n_tiles,
            split,
            greedy,
            gemv_rows,
            fuse_norm,
        } = *shape;
        let m = s.meta.ptr();
        let gemv_launches = std::cell::Cell::new(0u64);
        let (h, ffn, qd, kvd) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        let eps = c.rms_norm_eps as f32;
        let dims = self.dims();
        let act = self.act;
        let e = dev_err;
        // Products sharing their input (q, k, v; gate, up): one matrix-vector launch where the
        // kernel takes them all (decode rows), cuBLAS otherwise. With `norm` the input is the
        // RMSNorm of the f32 residual `x`: folded into the matrix-vector kernel when it runs,
        // else the norm kernel writes the normalized rows first.
        let prod = |ws: &[(&Mat, u64)], x: u64, norm: Option<u64>, rows: usize, beta: f32| {
            let w0 = ws[0].0;
            let same = ws
                .iter()
                .all(|(w, _)| w.kind == w0.kind && w.cols == w0.cols);
            // On the stack (this runs for every product of every step); more matrices than a
            // launch takes leave it empty, which the kernel refuses (cuBLAS then).
            let mut buf = [GemvOut {
                w: 0,
                out_dim: 0,
                y: 0,
            }; GEMV_MAX_OUTS];
            let outs = if ws.len() <= GEMV_MAX_OUTS {
                for (o, &(w, y)) in buf.iter_mut().zip(ws) {
                    *o = GemvOut {
                        w: w.ptr,
                        out_dim: w.rows,
                        y,
                    };
                }
                &buf[..ws.len()]
            } else {
                &buf[..0]
            };
            let input = |x: u64, kind: Elem, norm: Option<GemvNorm>| GemvIn {
                x,
                kind,
                rows,
                in_dim: w0.cols,
                norm,
            };
            let mut x = x;
            if let Some(w) = norm {
                let fused = input(x, Elem::F32, Some(GemvNorm { w, eps }));
                if same && fuse_norm && fused.fits(w0.kind, outs, gemv_rows) {
                    gemv_launches.set(gemv_launches.get() + 1);
                    return g.gemv(w0.kind, outs, &fused, beta).map_err(e);
                }
                g.rmsnorm(x, 0, w, rows, w0.cols, eps, s.xn.ptr(), act)
                    .map_err(e)?;
                x = s.xn.ptr();
            }
            let plain = input(x, act, None);
            if same && plain.fits(w0.kind, outs, gemv_rows) {
                gemv_launches.set(gemv_launches.get() + 1);
                return g.gemv(w0.kind, outs, &plain, beta).map_err(e);
            }
            for &(w, y) in ws {
                g.gemm(w.ptr, w.kind, w.rows, w.cols, x, rows, y, beta)
                    .map_err(e)?;
            }
            Ok(())
        };
        g.embed(
            self.embed.ptr,
            self.embed.kind,
            m + at.tokens,
            n,
            h,
            s.x.ptr(),
        )
        .map_err(e)?;
        for (li, l) in self.layers.iter().enumerate() {
            let qkv = [(&l.q, s.q.ptr()), (&l.k, s.k.ptr()), (&l.v, s.v.ptr())];
            prod(&qkv, s.x.ptr(), Some(l.attn_norm.ptr()), n, 0.0)?;
            for (buf, bias, d) in [
                (&s.q, &l.q_bias, qd),
                (&s.k, &l.k_bias, kvd),
                (&s.v, &l.v_bias, kvd),
            ] {
                if let Some(b) = bias {
                    g.add_bias(buf.ptr(), b.ptr(), d, n * d).map_err(e)?;
                }
            }
            let layer_off = kv.layout.layer_off(li);
            g.rope_store(
                s.q.ptr(),
                s.k.ptr(),
                s.v.ptr(),
                m + at.cos,
                m + at.sin,
                n,
                dims,
                kv.k.ptr(),
                kv.v.ptr(),
                kv.kind,
                m + at.slot,
                layer_off,
            )
            .map_err(e)?;
            let paging = Paging {
                rows: 0,
                pos: m + at.pos,
                table_off: m + at.table_off,
                tables: m + at.tables,
                block_size: kv.layout.block_size,
                block_stride: kv.layout.block_stride(),
                layer_off,
            };
            let (q, kc, vc, att) = (s.q.ptr(), kv.k.ptr(), kv.v.ptr(), s.att.ptr());
            if tiled {
                // Decodes: the per-row kernel (positions spread over its warps); prefill
                // chunks: tiles sharing staged keys and values.
                if n_decode > 0 {
                    let p = Paging {
                        rows: m + at.decode_rows,
                        ..paging
                    };
                    g.attention(q, kc, vc, kv.kind, p, n_decode, dims, att, act, split)
                        .map_err(e)?;
                }
                let tiles = Tiles {
                    row0: m + at.tile_row0,
                    count: m + at.tile_rows,
                    n: n_tiles,
                };
                g.attention_prefill(q, kc, vc, kv.kind, tiles, paging, dims, att, act)
                    .map_err(e)?;
            } else {
                g.attention(q, kc, vc, kv.kind, paging, n, dims, att, act, split)
                    .map_err(e)?;
            }
            prod(&[(&l.o, s.x.ptr())], s.att.ptr(), None, n, 1.0)?;
            let gate_up = [(&l.gate, s.g.ptr()), (&l.up, s.u.ptr())];
            prod(&gate_up, s.x.ptr(), Some(l.mlp_norm.ptr()), n, 0.0)?;
            g.silu_mul(s.g.ptr(), s.u.ptr(), s.hid.ptr(), act, n * ffn)
                .map_err(e)?;
            prod(&[(&l.down, s.x.ptr())], s.hid.ptr(), None, n, 1.0)?;
        }
        g.rmsnorm(
            s.x.ptr(),
            m + at.picked,
            self.norm.ptr(),
            p,
            h,
            eps,
            s.xn.ptr(),
            act,
        )
        .map_err(e)?;
        prod(&[(&self.lm_head, s.logits.ptr())], s.xn.ptr(), None, p, 0.0)?;
        if greedy {
            g.argmax_rows(s.logits.ptr(), p, c.vocab_size, s.ids.ptr())
                .map_err(e)?;
        }
        Ok(gemv_launches.get())
    }
}

/// Marker for element types every bit pattern of which is a valid value.
trait Plain: Copy + Default {}
impl Plain for f32 {}
impl Plain for u32 {}

/// `n` elements from the start of `buf`, copied straight into their vector (no byte staging).
fn download<D: DeviceOps, T: Plain>(g: &D, buf: &D::Buf, n: usize) -> Result<Vec<T>, RuntimeError> {
    let mut v = vec![T::default(); n];
    // SAFETY: `T` is f32 or u32 (`Plain`): any bytes the device writes are a valid value, and
    // the byte view covers exactly the vector's initialized elements.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(&v[..]))
    };
    g.download(buf, 0, bytes).map_err(dev_err)?;
    Ok(v)
}
