//! # thaw-cuda-emu: the CUDA kernels on the CPU, for tests
//!
//! `kernels/src/cuda/*.cu` compiled as C++ (see `cpp/shim.h`): each CUDA thread is an OS
//! thread, blocks run one after another, `__syncthreads` and warp shuffles are barriers. Slow,
//! but the same source the GPU runs — so the kernels' indexing, online softmax, warp merges and
//! 16-bit conversions are tested against the CPU backend on machines without a GPU
//! (`thaw-kernels/tests/cuda_emu.rs`). Device addresses are host pointers here.
//!
//! Every wrapper checks its slices' lengths against the launch before the call.

/// Element kinds, as the kernels' `kind` arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

impl Kind {
    pub fn bytes(self) -> usize {
        if self == Kind::F32 {
            4
        } else {
            2
        }
    }
}

type I64 = i64;

extern "C" {
    fn thaw_emu_widen(grid: u32, block: u32, src: *const u8, kind: i32, dst: *mut f32, n: I64);
    fn thaw_emu_embed(
        rows: u32,
        block: u32,
        table: *const u8,
        kind: i32,
        ids: *const u32,
        d: i32,
        out: *mut f32,
    );
    fn thaw_emu_rmsnorm(
        rows: u32,
        block: u32,
        x: *const f32,
        map: *const u32,
        w: *const f32,
        d: i32,
        eps: f32,
        out: *mut u8,
        out_kind: i32,
    );
    fn thaw_emu_add_bias(grid: u32, block: u32, x: *mut f32, b: *const f32, d: i32, n: I64);
    fn thaw_emu_silu_mul(
        grid: u32,
        block: u32,
        g: *const f32,
        u: *const f32,
        out: *mut u8,
        out_kind: i32,
        n: I64,
    );
    fn thaw_emu_rope_store(
        rows: u32,
        block: u32,
        q: *mut f32,
        k: *const f32,
        v: *const f32,
        cos: *const f32,
        sin: *const f32,
        n_heads: i32,
        n_kv: i32,
        hd: i32,
        kc: *mut u8,
        vc: *mut u8,
        kv_kind: i32,
        slot: *const I64,
        layer_off: I64,
    );
    fn thaw_emu_argmax_rows(rows: u32, block: u32, x: *const f32, n: i32, ids: *mut u32);
    fn thaw_emu_gemv(
        which: i32,
        grid: u32,
        block: u32,
        w0: *const u8,
        w1: *const u8,
        w2: *const u8,
        y0: *mut f32,
        y1: *mut f32,
        y2: *mut f32,
        n0: i32,
        n1: i32,
        n2: i32,
        w_kind: i32,
        x: *const u8,
        rows: i32,
        k: i32,
        norm: *const f32,
        eps: f32,
        beta: f32,
    );
    fn thaw_emu_attention(
        rows: u32,
        kv_heads: u32,
        q: *const f32,
        kc: *const u8,
        vc: *const u8,
        kv_kind: i32,
        rows_map: *const u32,
        pos: *const u32,
        table_off: *const u32,
        tables: *const u32,
        block_size: i32,
        block_stride: I64,
        layer_off: I64,
        n_heads: i32,
        n_kv: i32,
        hd: i32,
        scale: f32,
        out: *mut u8,
        out_kind: i32,
        chunk: i32,
        nsplit: i32,
        part: *mut f32,
    );
    fn thaw_emu_selftest_shuffle_after_exit(exit_lanes: i32, out: *mut f32);
    fn thaw_emu_attention_prefill(
        tiles: u32,
        kv_heads: u32,
        q: *const f32,
        kc: *const u8,
        vc: *const u8,
        kv_kind: i32,
        tile_row0: *const u32,
        tile_rows: *const u32,
        pos: *const u32,
        table_off: *const u32,
        tables: *const u32,
        block_size: i32,
        block_stride: I64,
        layer_off: I64,
        n_heads: i32,
        n_kv: i32,
        hd: i32,
        scale: f32,
        out: *mut u8,
        out_kind: i32,
    );
}

/// Plain element types whose bytes the kernels read and write (no padding, any bit pattern
/// valid).
trait Pod: Copy {}
impl Pod for u8 {}
impl Pod for u32 {}
impl Pod for i64 {}
impl Pod for f32 {}

/// A copy of `s` in fenced memory (guard pages at both ends: [`fence`]), so a kernel reading
/// past the slice faults instead of reading the test's other data.
fn fenced<T: Pod>(s: &[T]) -> fence::Fenced {
    // SAFETY: T is Pod: its bytes are initialized plain data.
    let bytes =
        unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) };
    fence::Fenced::from_slice(bytes)
}

/// Copies a kernel's output back from its fenced copy.
fn copy_back<T: Pod>(f: &fence::Fenced, s: &mut [T]) {
    // SAFETY: T is Pod, so any bytes are a valid T; the lengths match (the copy was made from s).
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s))
    };
    bytes.copy_from_slice(f.as_slice());
}

fn ptr<T>(f: &fence::Fenced) -> *const T {
    f.as_ptr() as *const T
}
fn mut_ptr<T>(f: &mut fence::Fenced) -> *mut T {
    f.as_mut_ptr() as *mut T
}

/// Attention head layout.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
}

pub fn widen(src: &[u8], kind: Kind, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * kind.bytes());
    let (fs, mut fd) = (fenced(src), fenced(dst));
    // SAFETY: lengths checked; the kernel touches n elements of each.
    unsafe {
        thaw_emu_widen(
            2,
            64,
            ptr(&fs),
            kind as i32,
            mut_ptr(&mut fd),
            dst.len() as I64,
        )
    }
    copy_back(&fd, dst);
}

pub fn embed(table: &[u8], kind: Kind, ids: &[u32], d: usize, out: &mut [f32]) {
    let rows = table.len() / kind.bytes() / d;
    assert!(ids.iter().all(|&i| (i as usize) < rows));
    assert_eq!(out.len(), ids.len() * d);
    let (ft, fi, mut fo) = (fenced(table), fenced(ids), fenced(out));
    // SAFETY: ids index rows of the table (checked); out holds ids.len() rows.
    unsafe {
        thaw_emu_embed(
            ids.len() as u32,
            64,
            ptr(&ft),
            kind as i32,
            ptr(&fi),
            d as i32,
            mut_ptr(&mut fo),
        )
    }
    copy_back(&fo, out);
}

/// RMSNorm of rows `map` (or all rows) of `x`, stored as `kind` into `out`.
pub fn rmsnorm(
    x: &[f32],
    map: Option<&[u32]>,
    w: &[f32],
    eps: f32,
    out: &mut [u8],
    kind: Kind,
    block: u32,
) {
    let d = w.len();
    let rows = map.map_or(x.len() / d, |m| m.len());
    if let Some(m) = map {
        assert!(m.iter().all(|&r| (r as usize + 1) * d <= x.len()));
    }
    assert_eq!(out.len(), rows * d * kind.bytes());
    let (fx, fm, fw, mut fo) = (fenced(x), map.map(fenced), fenced(w), fenced(out));
    // SAFETY: bounds checked above.
    unsafe {
        thaw_emu_rmsnorm(
            rows as u32,
            block,
            ptr(&fx),
            fm.as_ref().map_or(std::ptr::null(), ptr),
            ptr(&fw),
            d as i32,
            eps,
            mut_ptr(&mut fo),
            kind as i32,
        )
    }
    copy_back(&fo, out);
}

pub fn add_bias(x: &mut [f32], b: &[f32]) {
    assert_eq!(x.len() % b.len(), 0);
    let (mut fx, fb) = (fenced(x), fenced(b));
    // SAFETY: x holds n elements, b d.
    unsafe {
        thaw_emu_add_bias(
            3,
            64,
            mut_ptr(&mut fx),
            ptr(&fb),
            b.len() as i32,
            x.len() as I64,
        )
    }
    copy_back(&fx, x);
}

pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [u8], kind: Kind) {
    assert_eq!(g.len(), u.len());
    assert_eq!(out.len(), g.len() * kind.bytes());
    let (fg, fu, mut fo) = (fenced(g), fenced(u), fenced(out));
    // SAFETY: lengths checked.
    unsafe {
        thaw_emu_silu_mul(
            3,
            64,
            ptr(&fg),
            ptr(&fu),
            mut_ptr(&mut fo),
            kind as i32,
            g.len() as I64,
        )
    }
    copy_back(&fo, out);
}

/// RoPE on `q` (in place) and `k`, then keys and values of row `r` into `kc`/`vc` at
/// `slot[r] + layer_off`.
#[allow(clippy::too_many_arguments)]
pub fn rope_store(
    q: &mut [f32],
    k: &[f32],
    v: &[f32],
    cos: &[f32],
    sin: &[f32],
    h: Heads,
    kc: &mut [u8],
    vc: &mut [u8],
    kind: Kind,
    slot: &[i64],
    layer_off: usize,
) {
    let rows = slot.len();
    let kvd = h.n_kv * h.head_dim;
    assert_eq!(q.len(), rows * h.n_heads * h.head_dim);
    assert_eq!(k.len(), rows * kvd);
    assert_eq!(v.len(), rows * kvd);
    assert_eq!(cos.len(), rows * h.head_dim / 2);
    assert_eq!(sin.len(), cos.len());
    assert_eq!(kc.len(), vc.len());
    assert!(slot
        .iter()
        .all(|&s| (s as usize + layer_off + kvd) * kind.bytes() <= kc.len()));
    let (mut fq, fk, fv, fcos, fsin) = (fenced(q), fenced(k), fenced(v), fenced(cos), fenced(sin));
    let (mut fkc, mut fvc, fslot) = (fenced(kc), fenced(vc), fenced(slot));
    // SAFETY: every slot's row lies inside the caches (checked); the rest by the asserts.
    unsafe {
        thaw_emu_rope_store(
            rows as u32,
            128,
            mut_ptr(&mut fq),
            ptr(&fk),
            ptr(&fv),
            ptr(&fcos),
            ptr(&fsin),
            h.n_heads as i32,
            h.n_kv as i32,
            h.head_dim as i32,
            mut_ptr(&mut fkc),
            mut_ptr(&mut fvc),
            kind as i32,
            ptr(&fslot),
            layer_off as I64,
        )
    }
    copy_back(&fq, q);
    copy_back(&fkc, kc);
    copy_back(&fvc, vc);
}

/// The paged layout attention reads: `block_size` positions per block, blocks
/// `block_stride` elements apart, this layer at `layer_off`.
#[derive(Debug, Clone, Copy)]
pub struct Paging {
    pub block_size: usize,
    pub block_stride: usize,
    pub layer_off: usize,
}

/// `ids[r]` = first index of the maximum of row `r` (rows of `n`), with `block` threads per row.
pub fn argmax_rows(x: &[f32], n: usize, ids: &mut [u32], block: u32) {
    assert_eq!(x.len(), ids.len() * n);
    assert!(block.is_power_of_two() && (32..=1024).contains(&block));
    let (fx, mut fi) = (fenced(x), fenced(ids));
    // SAFETY: lengths checked.
    unsafe {
        thaw_emu_argmax_rows(
            ids.len() as u32,
            block,
            ptr(&fx),
            n as i32,
            mut_ptr(&mut fi),
        )
    }
    copy_back(&fi, ids);
}

/// Causal paged attention for rows at `pos`, each reading its table at `table_off` in `tables`;
/// with `chunk` > 0, in splits of `chunk` positions merged by `attention_merge`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    kc: &[u8],
    vc: &[u8],
    kind: Kind,
    pos: &[u32],
    table_off: &[u32],
    tables: &[u32],
    p: Paging,
    h: Heads,
    out: &mut [u8],
    out_kind: Kind,
    chunk: usize,
) {
    let rows = pos.len();
    let kvd = h.n_kv * h.head_dim;
    assert_eq!(table_off.len(), rows);
    // Flash-decoding with `chunk` > 0: as many splits as the longest row needs.
    let nsplit = match chunk {
        0 => 1,
        c => pos.iter().map(|&p| p as usize / c + 1).max().unwrap_or(1),
    };
    let part = vec![0f32; rows * h.n_heads * nsplit * (h.head_dim + 2)];
    assert_eq!(q.len(), rows * h.n_heads * h.head_dim);
    assert_eq!(out.len(), q.len() * out_kind.bytes());
    let blocks = kc.len() / kind.bytes() / p.block_stride;
    for r in 0..rows {
        let need = pos[r] as usize / p.block_size + 1;
        let t = &tables[table_off[r] as usize..table_off[r] as usize + need];
        assert!(t.iter().all(|&b| (b as usize) < blocks));
        assert!(p.layer_off + (p.block_size - 1) * kvd + kvd <= p.block_stride);
    }
    let (fq, fkc, fvc) = (fenced(q), fenced(kc), fenced(vc));
    let (fpos, foff, ftab) = (fenced(pos), fenced(table_off), fenced(tables));
    let (mut fo, mut fpart) = (fenced(out), fenced(&part));
    // SAFETY: every position each row reads lies inside the caches (checked above).
    unsafe {
        thaw_emu_attention(
            rows as u32,
            h.n_kv as u32,
            ptr(&fq),
            ptr(&fkc),
            ptr(&fvc),
            kind as i32,
            std::ptr::null(),
            ptr(&fpos),
            ptr(&foff),
            ptr(&ftab),
            p.block_size as i32,
            p.block_stride as I64,
            p.layer_off as I64,
            h.n_heads as i32,
            h.n_kv as i32,
            h.head_dim as i32,
            1.0 / (h.head_dim as f32).sqrt(),
            mut_ptr(&mut fo),
            out_kind as i32,
            chunk as i32,
            nsplit as i32,
            mut_ptr(&mut fpart),
        )
    }
    copy_back(&fo, out);
}

/// Flash-style prefill attention over `tiles` (first row, row count) of consecutive rows of one
/// sequence each; rows outside every tile are left untouched in `out`.
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    q: &[f32],
    kc: &[u8],
    vc: &[u8],
    kind: Kind,
    tiles: &[(u32, u32)],
    pos: &[u32],
    table_off: &[u32],
    tables: &[u32],
    p: Paging,
    h: Heads,
    out: &mut [u8],
    out_kind: Kind,
) {
    let rows = pos.len();
    let kvd = h.n_kv * h.head_dim;
    assert_eq!(q.len(), rows * h.n_heads * h.head_dim);
    assert_eq!(out.len(), q.len() * out_kind.bytes());
    let blocks = kc.len() / kind.bytes() / p.block_stride;
    assert!(p.layer_off + (p.block_size - 1) * kvd + kvd <= p.block_stride);
    for &(r0, n) in tiles {
        assert!((1..=4).contains(&n) && (r0 + n) as usize <= rows);
        for r in r0..r0 + n {
            assert_eq!(table_off[r as usize], table_off[r0 as usize]);
            assert_eq!(pos[r as usize], pos[r0 as usize] + (r - r0));
        }
        let need = pos[(r0 + n - 1) as usize] as usize / p.block_size + 1;
        let off = table_off[r0 as usize] as usize;
        assert!(tables[off..off + need]
            .iter()
            .all(|&b| (b as usize) < blocks));
    }
    let row0: Vec<u32> = tiles.iter().map(|t| t.0).collect();
    let count: Vec<u32> = tiles.iter().map(|t| t.1).collect();
    let (fq, fkc, fvc, fr0, fcount) = (
        fenced(q),
        fenced(kc),
        fenced(vc),
        fenced(&row0),
        fenced(&count),
    );
    let (fpos, foff, ftab, mut fo) = (fenced(pos), fenced(table_off), fenced(tables), fenced(out));
    // SAFETY: tiles are consecutive rows of one sequence whose blocks lie in the caches
    // (checked above).
    unsafe {
        thaw_emu_attention_prefill(
            tiles.len() as u32,
            h.n_kv as u32,
            ptr(&fq),
            ptr(&fkc),
            ptr(&fvc),
            kind as i32,
            ptr(&fr0),
            ptr(&fcount),
            ptr(&fpos),
            ptr(&foff),
            ptr(&ftab),
            p.block_size as i32,
            p.block_stride as I64,
            p.layer_off as I64,
            h.n_heads as i32,
            h.n_kv as i32,
            h.head_dim as i32,
            1.0 / (h.head_dim as f32).sqrt(),
            mut_ptr(&mut fo),
            out_kind as i32,
        )
    }
    copy_back(&fo, out);
}

/// The emulator checking itself: `exit_lanes` lanes of a warp return, then the rest sum ones
/// over the full warp. With 0, the sum (32); otherwise the process aborts, as a full-warp
/// shuffle after lanes returned is undefined on a GPU.
pub fn selftest_shuffle_after_exit(exit_lanes: u32) -> f32 {
    assert!(exit_lanes < 32);
    let mut out = 0f32;
    // SAFETY: the kernel writes one f32 to `out`.
    unsafe { thaw_emu_selftest_shuffle_after_exit(exit_lanes as i32, &mut out) };
    out
}

pub mod device;
pub mod fence;
