//! One GPU, ready to compute: context, one stream, cuBLAS on that stream, the compiled kernels,
//! and typed launches of each.
//!
//! Everything runs on the one stream, so kernels and copies are ordered by the stream alone.
//! cudarc's per-buffer event tracking (for multi-stream safety) is therefore switched off, and
//! kernels take raw device addresses ([`DevBuf::ptr`] plus an offset): weights are views into
//! the loader's per-shard allocations, not separate buffers. Callers keep every buffer a queued
//! kernel uses alive until the stream is synchronized ([`Gpu::sync`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};

use super::{compile, CudaError, DeviceInfo};
use crate::device::{AttnDims, DeviceBuf, DeviceOps, Elem, GemmCall, Paging, Split, Tiles};

fn drv(e: impl std::fmt::Display) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn blas_type(e: Elem) -> blas_sys::cudaDataType {
    match e {
        Elem::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        Elem::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        Elem::F16 => blas_sys::cudaDataType::CUDA_R_16F,
    }
}

/// A device allocation and its address.
pub struct DevBuf {
    mem: CudaSlice<u8>,
    ptr: u64,
}

impl DevBuf {
    /// Wraps an allocation (e.g. one of the loader's shards).
    pub fn new(mem: CudaSlice<u8>, stream: &CudaStream) -> DevBuf {
        let ptr = {
            let (p, _sync) = mem.device_ptr(stream);
            p
        };
        DevBuf { mem, ptr }
    }
}

impl DeviceBuf for DevBuf {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.mem.len()
    }
}

/// Time spent bringing the GPU up: the CUDA-specific cold-start phases.
#[derive(Debug, Clone, Default)]
pub struct GpuInit {
    /// Creating the context (driver load, device attach).
    pub context_s: f64,
    /// NVRTC compile, or reading the cached PTX.
    pub compile_s: f64,
    pub compile_cache_hit: bool,
    /// Loading the module (the driver's PTX → SASS step) and cuBLAS.
    pub module_s: f64,
}

struct Kernels {
    widen: CudaFunction,
    embed: CudaFunction,
    rmsnorm: CudaFunction,
    add_bias: CudaFunction,
    silu_mul: CudaFunction,
    rope_store: CudaFunction,
    attention: CudaFunction,
    attention_merge: CudaFunction,
    attention_prefill: CudaFunction,
    argmax_rows: CudaFunction,
    gemv: CudaFunction,
    gemv1: CudaFunction,
    gemv1v: CudaFunction,
    gemv1r: CudaFunction,
    read_probe: CudaFunction,
}

pub struct Gpu {
    /// One-row products take 16-byte loads (`gemv1r`, `gemv1v`) where they are 16-byte aligned
    /// (default; off: 8-byte loads, `gemv1`, for A/B measurements).
    pub gemv_vec16: std::sync::atomic::AtomicBool,
    /// Of those, the ones whose activations fit shared memory go to the warp-per-rows kernel
    /// `gemv1r` (default; off: the block-per-4-outputs `gemv1v`, for A/B measurements).
    pub gemv_warp_rows: std::sync::atomic::AtomicBool,
    /// `gemv` launches only as many blocks as the device holds at once (each strides over
    /// output groups, computing a folded norm once) instead of one block per group.
    pub gemv_persistent: std::sync::atomic::AtomicBool,
    /// Blocks of 256 threads of `gemv`, `gemv1`, `gemv1v`, `gemv1r` the device holds at once.
    gemv_resident: [u32; 4],
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace (after `blas`: dropped after the handle that uses it).
    _blas_workspace: cudarc::driver::CudaSlice<u8>,
    k: Kernels,
    pub info: DeviceInfo,
    pub init: GpuInit,
}

/// Warps per block of the `attention` (decode) and `attention_prefill` kernels (attention.cu's
/// DEC_WARPS and ATT_WARPS).
const DEC_WARPS: u32 = 8;
const ATT_WARPS: u32 = 4;

fn grid_1d(n: usize, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(block as usize).clamp(1, 65_535 * 4) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows_cfg(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A device's context and compute stream, before its kernels and cuBLAS exist: what a weight
/// load needs to start (the loader allocates and copies with the context alone), so
/// [`Gpu::finish`] can run beside it.
pub struct GpuContext {
    pub ctx: Arc<CudaContext>,
    pub info: DeviceInfo,
    stream: Arc<CudaStream>,
    context_s: f64,
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or finds cached) kernels, creates cuBLAS.
    pub fn open(ordinal: usize, ptx_cache: Option<&Path>) -> Result<Gpu, CudaError> {
        Gpu::finish(Gpu::open_context(ordinal)?, ptx_cache)
    }

    /// The first half of [`Gpu::open`]: the context (the `device_init` phase) and the compute
    /// stream.
    pub fn open_context(ordinal: usize) -> Result<GpuContext, CudaError> {
        let t = Instant::now();
        let (ctx, info) = super::open(ordinal)?;
        // SAFETY: thaw uses one stream per context for compute, so cross-stream tracking events
        // are never needed; the loader's copy stream is synchronized before its data is used.
        unsafe { ctx.disable_event_tracking() };
        // Its own stream (not the legacy default one, which serializes with every other
        // blocking stream and cannot be captured into a CUDA graph).
        let stream = ctx.new_stream().map_err(drv)?;
        Ok(GpuContext {
            ctx,
            info,
            stream,
            context_s: t.elapsed().as_secs_f64(),
        })
    }

    /// The second half of [`Gpu::open`]: the kernels compiled (or read from `ptx_cache`) and
    /// loaded, cuBLAS created on the compute stream.
    pub fn finish(c: GpuContext, ptx_cache: Option<&Path>) -> Result<Gpu, CudaError> {
        let GpuContext {
            ctx,
            info,
            stream,
            context_s,
        } = c;
        let arch = info.compute_capability;
        let mut image = compile::module_image(arch, ptx_cache)?;
        let t = Instant::now();
        let load_all = |image: &compile::Compiled| {
            (0..compile::PARTS.len())
                .map(|i| ctx.load_module(image.module_input(i)))
                .collect::<Result<Vec<_>, _>>()
        };
        let modules = match load_all(&image) {
            Ok(m) => m,
            Err(_) if image.cache_hit => {
                // A cached image the driver refuses (e.g. written by a newer NVRTC): compile
                // anew.
                if let Some(dir) = ptx_cache {
                    compile::forget(arch, image.form, dir);
                }
                image = compile::module_image(arch, ptx_cache)?;
                load_all(&image).map_err(drv)?
            }
            Err(e) => return Err(drv(e)),
        };
        let f = |name: &str| {
            let part = compile::part_of(name)
                .ok_or_else(|| CudaError::Driver(format!("kernel {name} is in no part")))?;
            modules[part].load_function(name).map_err(drv)
        };
        let k = Kernels {
            widen: f("widen")?,
            embed: f("embed")?,
            rmsnorm: f("rmsnorm")?,
            add_bias: f("add_bias")?,
            silu_mul: f("silu_mul")?,
            rope_store: f("rope_store")?,
            attention: f("attention")?,
            attention_merge: f("attention_merge")?,
            attention_prefill: f("attention_prefill")?,
            argmax_rows: f("argmax_rows")?,
            gemv: f("gemv")?,
            gemv1: f("gemv1")?,
            gemv1v: f("gemv1v")?,
            gemv1r: f("gemv1r")?,
            read_probe: f("read_probe")?,
        };
        // SAFETY: only probes whether the library can be opened (cudarc panics on a call into a
        // library it cannot load).
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::Driver(
                "libcublas could not be loaded (install the CUDA libraries or set LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(drv)?;
        // A workspace of cuBLAS's own, set once: without one cuBLAS allocates its workspace
        // when a product first needs it, which a CUDA graph capture refuses (32 MiB: NVIDIA's
        // recommendation for Hopper).
        let blas_workspace = stream.alloc_zeros::<u8>(32 << 20).map_err(drv)?;
        {
            let (ptr, _sync) = blas_workspace.device_ptr(&stream);
            // SAFETY: the workspace is device memory of the stated size that lives as long as
            // the handle (the field after `blas` in `Gpu`, so dropped after it).
            unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, 32 << 20) }
                .result()
                .map_err(|e| CudaError::Driver(format!("cublasSetWorkspace: {e:?}")))?;
        }
        // (Only the persistent A/B launch uses these: a failed query is one block per
        // multiprocessor, not a failed open.)
        let resident = |f: &CudaFunction| -> u32 {
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(256, 0, None)
                .unwrap_or(1);
            per_sm.max(1) * info.sm_count as u32
        };
        let gemv_resident = [
            resident(&k.gemv),
            resident(&k.gemv1),
            resident(&k.gemv1v),
            resident(&k.gemv1r),
        ];
        let module_s = t.elapsed().as_secs_f64();
        Ok(Gpu {
            gemv_vec16: std::sync::atomic::AtomicBool::new(true),
            gemv_warp_rows: std::sync::atomic::AtomicBool::new(true),
            gemv_persistent: std::sync::atomic::AtomicBool::new(false),
            gemv_resident,
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            k,
            info,
            init: GpuInit {
                context_s,
                compile_s: image.seconds,
                compile_cache_hit: image.cache_hit,
                module_s,
            },
        })
    }

    /// Measures device-memory read bandwidth over `buf` (bytes/s, best of `reps`): the HBM
    /// roofline decode is held against.
    pub fn read_bandwidth(&self, buf: &DevBuf, reps: usize) -> Result<f64, CudaError> {
        let n4 = (buf.len() / 16) as i64;
        let sink = self.alloc(16)?;
        let (p, s) = (buf.ptr(), sink.ptr());
        let sms = self
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv)? as u32;
        let cfg = LaunchConfig {
            grid_dim: (sms * 8, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut best = 0f64;
        for _ in 0..reps.max(1) + 1 {
            self.sync()?;
            let t = Instant::now();
            let mut b = self.stream.launch_builder(&self.k.read_probe);
            b.arg(&p).arg(&n4).arg(&s);
            // SAFETY: reads n4 float4 inside buf; writes at most one float into sink.
            unsafe { b.launch(cfg) }.map_err(drv)?;
            self.sync()?;
            best = best.max((n4 * 16) as f64 / t.elapsed().as_secs_f64());
        }
        Ok(best)
    }
}

/// The scalar arguments both attention kernels share, converted once to the kernels' types.
struct AttnArgs {
    kv_kind: i32,
    block_size: i32,
    block_stride: i64,
    layer_off: i64,
    n_heads: i32,
    n_kv: i32,
    head_dim: i32,
    scale: f32,
    out_kind: i32,
}

impl AttnArgs {
    fn new(kv: Elem, p: Paging, s: AttnDims, out: Elem) -> Result<AttnArgs, CudaError> {
        s.check().map_err(CudaError::Unsupported)?;
        if kv == Elem::F16 {
            // (KV caches are f32 or bf16; the kernels are compiled for those two.)
            return Err(CudaError::Unsupported("an f16 KV cache".into()));
        }
        Ok(AttnArgs {
            kv_kind: kv.code(),
            block_size: p.block_size as i32,
            block_stride: p.block_stride as i64,
            layer_off: p.layer_off as i64,
            n_heads: s.n_heads as i32,
            n_kv: s.n_kv_heads as i32,
            head_dim: s.head_dim as i32,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            out_kind: out.code(),
        })
    }

    /// The kernels' common tail: `pos_of_row, table_off, tables, block_size, block_stride,
    /// layer_off, n_heads, n_kv, hd, scale, out, out_kind`.
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>, p: &'a Paging, out: &'a u64) {
        b.arg(&p.pos)
            .arg(&p.table_off)
            .arg(&p.tables)
            .arg(&self.block_size)
            .arg(&self.block_stride)
            .arg(&self.layer_off)
            .arg(&self.n_heads)
            .arg(&self.n_kv)
            .arg(&self.head_dim)
            .arg(&self.scale)
            .arg(out)
            .arg(&self.out_kind);
    }

    /// One block of `warps` warps (attention.cu: DEC_WARPS for `attention`, ATT_WARPS for
    /// `attention_prefill`) per (row or tile, KV head).
    fn grid(&self, n: usize, warps: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n as u32, self.n_kv as u32, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A recorded decode step (CUDA graph, instantiated and uploaded).
pub struct GpuGraph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread as long as no two calls on one graph
// run at once; the model keeps its graphs behind a mutex and only replays them under it.
unsafe impl Send for GpuGraph {}

impl DeviceOps for Gpu {
    type Buf = DevBuf;
    type Error = CudaError;

    /// `len` bytes of device memory, zeroed.
    fn alloc(&self, len: usize) -> Result<DevBuf, CudaError> {
        let mem = self.stream.alloc_zeros::<u8>(len.max(1)).map_err(drv)?;
        Ok(DevBuf::new(mem, &self.stream))
    }

    /// Copies `src` into `dst` at byte offset `at`.
    fn upload(&self, dst: &mut DevBuf, at: usize, bytes: &[u8]) -> Result<(), CudaError> {
        if at + bytes.len() > dst.len() {
            return Err(CudaError::Driver(format!(
                "upload of {} bytes at {at} overruns a {}-byte buffer",
                bytes.len(),
                dst.len()
            )));
        }
        let mut view = dst.mem.slice_mut(at..at + bytes.len());
        self.stream.memcpy_htod(bytes, &mut view).map_err(drv)
    }

    /// Copies `dst.len()` bytes from `src` at byte offset `at`, after everything queued before.
    fn download(&self, src: &DevBuf, at: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        let n = dst.len();
        if at + n > src.len() {
            return Err(CudaError::Driver("download overruns its buffer".into()));
        }
        let view = src.mem.slice(at..at + n);
        self.stream.memcpy_dtoh(&view, dst).map_err(drv)?;
        self.sync()
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv)
    }

    fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(drv)
    }

    type Graph = GpuGraph;
    /// Stream capture in thread-local mode: other threads (the loader, an engine beside this
    /// one) may keep allocating and copying meanwhile.
    fn begin_capture(&self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(drv)
    }
    fn end_capture(&self) -> Result<GpuGraph, CudaError> {
        let g = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(drv)?
            .ok_or_else(|| CudaError::Driver("the capture recorded nothing".into()))?;
        // Uploaded now, so that the first replay does not pay the graph's setup.
        g.upload().map_err(drv)?;
        Ok(GpuGraph(g))
    }
    fn replay(&self, g: &GpuGraph) -> Result<(), CudaError> {
        g.0.launch().map_err(drv)
    }

    /// `dst[i] = src[i]` as f32 (`n` elements of kind `kind`).
    fn widen(&self, src: u64, kind: Elem, dst: u64, n: usize) -> Result<(), CudaError> {
        let (code, n64) = (kind.code(), n as i64);
        let mut b = self.stream.launch_builder(&self.k.widen);
        b.arg(&src).arg(&code).arg(&dst).arg(&n64);
        // SAFETY: the kernel reads n elements at src and writes n f32 at dst (caller's buffers).
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(drv)?;
        Ok(())
    }

    /// `out[r] = table[ids[r]]` widened to f32, rows of `d`.
    fn embed(
        &self,
        table: u64,
        kind: Elem,
        ids: u64,
        n: usize,
        d: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        let (code, d32) = (kind.code(), d as i32);
        let mut b = self.stream.launch_builder(&self.k.embed);
        b.arg(&table).arg(&code).arg(&ids).arg(&d32).arg(&out);
        // SAFETY: ids holds n valid row indices (checked on the host), out n·d f32.
        unsafe { b.launch(rows_cfg(n, 256)) }.map_err(drv)?;
        Ok(())
    }

    /// RMSNorm of `n` rows of `d` (row `rows[r]` of `x` when `rows` is nonzero), stored as `out_kind`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        x: u64,
        rows_map: u64,
        w: u64,
        n: usize,
        d: usize,
        eps: f32,
        out: u64,
        out_kind: Elem,
    ) -> Result<(), CudaError> {
        let (d32, code) = (d as i32, out_kind.code());
        let block = if d >= 2048 { 1024 } else { 256 };
        let mut b = self.stream.launch_builder(&self.k.rmsnorm);
        b.arg(&x)
            .arg(&rows_map)
            .arg(&w)
            .arg(&d32)
            .arg(&eps)
            .arg(&out)
            .arg(&code);
        // SAFETY: x holds the rows named, w d f32, out n·d elements.
        unsafe { b.launch(rows_cfg(n, block)) }.map_err(drv)?;
        Ok(())
    }

    /// `x[i] += bias[i % d]` for `n` elements.
    fn add_bias(&self, x: u64, bias: u64, d: usize, n: usize) -> Result<(), CudaError> {
        let (d32, n64) = (d as i32, n as i64);
        let mut b = self.stream.launch_builder(&self.k.add_bias);
        b.arg(&x).arg(&bias).arg(&d32).arg(&n64);
        // SAFETY: x holds n f32, bias d f32.
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(drv)?;
        Ok(())
    }

    /// `out = silu(g) · u` (`n` elements), stored as `out_kind`.
    fn silu_mul(
        &self,
        g: u64,
        u: u64,
        out: u64,
        out_kind: Elem,
        n: usize,
    ) -> Result<(), CudaError> {
        let (code, n64) = (out_kind.code(), n as i64);
        let mut b = self.stream.launch_builder(&self.k.silu_mul);
        b.arg(&g).arg(&u).arg(&out).arg(&code).arg(&n64);
        // SAFETY: g, u hold n f32; out n elements of out_kind.
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(drv)?;
        Ok(())
    }

    /// RoPE on `n` rows of queries (in place) and keys, then keys and values into the cache.
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        q: u64,
        k: u64,
        v: u64,
        cos: u64,
        sin: u64,
        n: usize,
        shape: AttnDims,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        slots: u64,
        layer_off: usize,
    ) -> Result<(), CudaError> {
        let (nh, nkv, hd) = (
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        );
        let (code, off) = (kv_kind.code(), layer_off as i64);
        let mut b = self.stream.launch_builder(&self.k.rope_store);
        b.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&cos)
            .arg(&sin)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&kc)
            .arg(&vc)
            .arg(&code)
            .arg(&slots)
            .arg(&off);
        // A row's query pairs, key pairs and values, in slices of 128 threads (grid.y).
        let half = shape.head_dim / 2;
        let work =
            shape.n_heads * half + shape.n_kv_heads * half + shape.n_kv_heads * shape.head_dim;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, work.div_ceil(128) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: slots (checked on the host against the store's size) address rows inside kc/vc.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// Causal paged GQA attention for `n` query rows (see `attention.cu`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        paging: Paging,
        n: usize,
        shape: AttnDims,
        out: u64,
        out_kind: Elem,
        split: Split,
    ) -> Result<(), CudaError> {
        let a = AttnArgs::new(kv_kind, paging, shape, out_kind)?;
        let (chunk, nsplit) = split.kernel_args();
        let mut b = self.stream.launch_builder(&self.k.attention);
        b.arg(&q)
            .arg(&kc)
            .arg(&vc)
            .arg(&a.kv_kind)
            .arg(&paging.rows);
        a.push(&mut b, &paging, &out);
        b.arg(&chunk).arg(&nsplit).arg(&split.partials);
        let mut cfg = a.grid(n, DEC_WARPS);
        cfg.grid_dim.1 *= nsplit as u32;
        // SAFETY: every row's table covers its positions and every block id is inside the
        // store (both checked on the host before the step); with splits, the partials buffer
        // holds n · heads · nsplit · (hd + 2) f32 and every row has at most nsplit of them
        // (the caller's plan).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        if chunk > 0 {
            let mut m = self.stream.launch_builder(&self.k.attention_merge);
            m.arg(&split.partials)
                .arg(&paging.rows)
                .arg(&paging.pos)
                .arg(&chunk)
                .arg(&nsplit)
                .arg(&a.n_heads)
                .arg(&a.head_dim)
                .arg(&out)
                .arg(&a.out_kind);
            let cfg = LaunchConfig {
                grid_dim: (n as u32, a.n_heads as u32, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; the splits of every row of more than one were written by
            // the launch before it on this stream.
            unsafe { m.launch(cfg) }.map_err(drv)?;
        }
        Ok(())
    }

    /// Flash-decoding past 128 positions per split, to about four blocks per multiprocessor.
    fn attention_split_target(&self) -> (usize, usize) {
        (4 * self.info.sm_count, 128)
    }

    fn attention_prefill(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        tiles: Tiles,
        paging: Paging,
        shape: AttnDims,
        out: u64,
        out_kind: Elem,
    ) -> Result<(), CudaError> {
        let a = AttnArgs::new(kv_kind, paging, shape, out_kind)?;
        let mut b = self.stream.launch_builder(&self.k.attention_prefill);
        b.arg(&q)
            .arg(&kc)
            .arg(&vc)
            .arg(&a.kv_kind)
            .arg(&tiles.row0)
            .arg(&tiles.count);
        a.push(&mut b, &paging, &out);
        // SAFETY: tiles hold consecutive rows of one sequence whose tables cover their
        // positions (built and checked on the host).
        unsafe { b.launch(a.grid(tiles.n, ATT_WARPS)) }.map_err(drv)?;
        Ok(())
    }

    fn argmax_rows(&self, x: u64, rows: usize, n: usize, ids: u64) -> Result<(), CudaError> {
        let n32 = n as i32;
        let mut b = self.stream.launch_builder(&self.k.argmax_rows);
        b.arg(&x).arg(&n32).arg(&ids);
        // SAFETY: x holds rows·n f32, ids rows u32 (the caller's scratch buffers).
        unsafe { b.launch(rows_cfg(rows, 1024)) }.map_err(drv)?;
        Ok(())
    }

    /// `y[n, out] = x[n, in] · Wᵀ + beta · y` with W `[out, in]` row-major in `w_kind`, x in the
    /// same kind, y f32, f32 accumulation (cuBLAS GemmEx; tensor cores for 16-bit kinds).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        w: u64,
        w_kind: Elem,
        out_dim: usize,
        in_dim: usize,
        x: u64,
        n: usize,
        y: u64,
        beta: f32,
    ) -> Result<(), CudaError> {
        let alpha = 1.0f32;
        let c = GemmCall::linear(out_dim, in_dim, n);
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the pointers address buffers of the stated shapes; alpha/beta are host f32
        // (the handle's default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(c.transa),
                op(c.transb),
                c.m as i32,
                c.n as i32,
                c.k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                blas_type(w_kind),
                c.lda as i32,
                x as *const _,
                blas_type(w_kind),
                c.ldb as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                blas_type(Elem::F32),
                c.ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(drv)
    }
    /// A block of 256 threads per 4 outputs (`gemv1r`: per 16, a warp per 2), up to three
    /// matrices per launch.
    fn gemv(
        &self,
        w_kind: Elem,
        outs: &[crate::device::GemvOut],
        x: &crate::device::GemvIn,
        beta: f32,
    ) -> Result<(), CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        if !x.fits(w_kind, outs, crate::device::GEMV_MAX_ROWS) {
            return Err(CudaError::Unsupported(format!(
                "gemv of {} rows of {} into {} matrices (x at {:#x})",
                x.rows,
                x.in_dim,
                outs.len(),
                x.x
            )));
        }
        let n = x.rows;
        let vec16 = n == 1 && self.gemv_vec16.load(Relaxed) && x.vec16(outs);
        let warp_rows = vec16 && self.gemv_warp_rows.load(Relaxed) && x.stages(w_kind);
        let (f, resident, per_block) = match (n, vec16, warp_rows) {
            (1, true, true) => (
                &self.k.gemv1r,
                self.gemv_resident[3],
                crate::device::GEMV_WARP_ROWS_PER_BLOCK,
            ),
            (1, true, false) => (&self.k.gemv1v, self.gemv_resident[2], 4),
            (1, false, _) => (&self.k.gemv1, self.gemv_resident[1], 4),
            _ => (&self.k.gemv, self.gemv_resident[0], 4),
        };
        let (mut w, mut y, mut dims) = ([0u64; 3], [0u64; 3], [0i32; 3]);
        for (i, o) in outs.iter().enumerate() {
            (w[i], y[i], dims[i]) = (o.w, o.y, o.out_dim as i32);
        }
        let blocks: usize = outs.iter().map(|o| o.out_dim.div_ceil(per_block)).sum();
        let kind = w_kind.code();
        let (rows, inn) = (n as i32, x.in_dim as i32);
        let (norm, eps) = x.norm.map_or((0u64, 0f32), |m| (m.w, m.eps));
        let mut b = self.stream.launch_builder(f);
        b.arg(&w[0])
            .arg(&w[1])
            .arg(&w[2])
            .arg(&y[0])
            .arg(&y[1])
            .arg(&y[2])
            .arg(&dims[0])
            .arg(&dims[1])
            .arg(&dims[2])
            .arg(&kind)
            .arg(&x.x)
            .arg(&rows)
            .arg(&inn)
            .arg(&norm)
            .arg(&eps)
            .arg(&beta);
        let mut grid = blocks as u32;
        if self.gemv_persistent.load(Relaxed) {
            grid = grid.min(resident);
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each W holds out_dim·in elements of w_kind, x n·in of its kind, a norm in f32,
        // each y n·out_dim f32 (the caller's buffers); alignment and kinds checked above; absent
        // matrices have 0 outputs.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}
