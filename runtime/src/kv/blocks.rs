//! Block allocation with reference counts and an LRU prefix cache.
//!
//! A block is in exactly one of three states:
//! * **in use** — `refs > 0`; held by one or more sequences (shared prefix blocks have refs > 1);
//! * **cached** — `refs == 0` but its content is registered under its chain hash: a later
//!   sequence with the same prefix can take it back at no cost; evicted least-recently-used when
//!   fresh blocks run out;
//! * **free** — `refs == 0`, no content worth keeping.
//!
//! Hash hits are confirmed against the stored parent hash and token ids, so a 64-bit collision
//! can never hand a sequence someone else's keys and values.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

pub type BlockId = u32;

/// Chain hash of a full block: its parent's hash and its token ids.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone)]
struct Content {
    hash: u64,
    parent: u64,
    tokens: Vec<u32>,
}

/// The cached prefix found for a prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Blocks now referenced by the caller (in order).
    pub blocks: Vec<BlockId>,
    /// Tokens they cover (`blocks.len() × block_size`).
    pub tokens: usize,
    /// Chain hash of the last matched block (0 when none): the parent for the next block.
    pub last_hash: u64,
}

pub struct BlockManager {
    block_size: usize,
    refs: Vec<u32>,
    content: Vec<Option<Content>>,
    index: HashMap<u64, BlockId>,
    free: Vec<BlockId>,
    /// Cached (refs == 0, registered) blocks by last use.
    lru: BTreeMap<u64, BlockId>,
    last_use: Vec<u64>,
    tick: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> BlockManager {
        assert!(block_size > 0 && num_blocks <= u32::MAX as usize);
        BlockManager {
            block_size,
            refs: vec![0; num_blocks],
            content: vec![None; num_blocks],
            index: HashMap::new(),
            free: (0..num_blocks as BlockId).rev().collect(),
            lru: BTreeMap::new(),
            last_use: vec![0; num_blocks],
            tick: 0,
            prefix_queries: 0,
            prefix_hits: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn total(&self) -> usize {
        self.refs.len()
    }
    /// Blocks that can be handed out now (free plus evictable cached ones).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }
    pub fn in_use(&self) -> usize {
        self.total() - self.available()
    }
    pub fn refs(&self, b: BlockId) -> u32 {
        self.refs[b as usize]
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn touch(&mut self, b: BlockId) {
        self.tick += 1;
        self.last_use[b as usize] = self.tick;
    }

    fn take_ref(&mut self, b: BlockId) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.lru.remove(&self.last_use[i]);
        }
        self.refs[i] += 1;
        self.touch(b);
    }

    /// The longest run of cached full blocks that starts `tokens`, referenced for the caller.
    /// At most `max_tokens` tokens are matched (a prompt's last token is always recomputed so
    /// that its logits exist).
    pub fn match_prefix(&mut self, tokens: &[u32], max_tokens: usize) -> PrefixMatch {
        let bs = self.block_size;
        let mut m = PrefixMatch {
            blocks: vec![],
            tokens: 0,
            last_hash: 0,
        };
        let full = tokens.len().min(max_tokens) / bs;
        self.prefix_queries += 1;
        for chunk in tokens.chunks_exact(bs).take(full) {
            let h = chain_hash(m.last_hash, chunk);
            let Some(&b) = self.index.get(&h) else { break };
            let ok = self.content[b as usize]
                .as_ref()
                .is_some_and(|c| c.parent == m.last_hash && c.tokens == chunk);
            if !ok {
                break;
            }
            self.take_ref(b);
            m.blocks.push(b);
            m.tokens += bs;
            m.last_hash = h;
        }
        if !m.blocks.is_empty() {
            self.prefix_hits += 1;
        }
        m
    }

    /// `n` fresh blocks (refs 1), evicting least-recently-used cached blocks if needed; `None`
    /// (and nothing taken) if fewer than `n` are available.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.available() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (&t, &b) = self.lru.iter().next().expect("available() counted it");
                    self.lru.remove(&t);
                    if let Some(c) = self.content[b as usize].take() {
                        if self.index.get(&c.hash) == Some(&b) {
                            self.index.remove(&c.hash);
                        }
                    }
                    b
                }
            };
            self.refs[b as usize] = 1;
            self.touch(b);
            out.push(b);
        }
        Some(out)
    }

    /// Registers block `b`, now full with `tokens` after a block whose chain hash is `parent`;
    /// returns its chain hash (the parent of the next block). If an identical block is already
    /// cached, `b` simply stays unregistered (both hold the same keys and values).
    pub fn register_full(&mut self, b: BlockId, parent: u64, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        let h = chain_hash(parent, tokens);
        if let std::collections::hash_map::Entry::Vacant(e) = self.index.entry(h) {
            e.insert(b);
            self.content[b as usize] = Some(Content {
                hash: h,
                parent,
                tokens: tokens.to_vec(),
            });
        }
        h
    }

    /// Drops one reference to each block; unreferenced blocks become cached (if registered) or free.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let i = b as usize;
            assert!(self.refs[i] > 0, "block {b} released more often than taken");
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                if self.content[i].is_some() {
                    self.touch(b);
                    self.lru.insert(self.last_use[i], b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// Checks every internal invariant; `held` is how many times each block is held by callers.
    pub fn check(&self, held: &HashMap<BlockId, u32>) -> Result<(), String> {
        let mut seen = vec![0u8; self.total()];
        for &b in &self.free {
            seen[b as usize] += 1;
            if self.refs[b as usize] != 0 || self.content[b as usize].is_some() {
                return Err(format!("free block {b} has refs or content"));
            }
        }
        for &b in self.lru.values() {
            seen[b as usize] += 1;
            if self.refs[b as usize] != 0 || self.content[b as usize].is_none() {
                return Err(format!("cached block {b} has refs or no content"));
            }
        }
        #[allow(clippy::needless_range_loop)] // `b` indexes refs and seen and names the block
        for b in 0..self.total() {
            let want = held.get(&(b as BlockId)).copied().unwrap_or(0);
            if self.refs[b] != want {
                return Err(format!(
                    "block {b}: refs {} but held {want} times",
                    self.refs[b]
                ));
            }
            let expected_seen = u8::from(self.refs[b] == 0);
            if seen[b] != expected_seen {
                return Err(format!(
                    "block {b} listed {} times in free/cached with refs {}",
                    seen[b], self.refs[b]
                ));
            }
        }
        for (h, &b) in &self.index {
            if self.content[b as usize].as_ref().map(|c| c.hash) != Some(*h) {
                return Err(format!(
                    "index entry {h:x} points at block {b} without that content"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A sequence as the engine would hold it.
    struct Seq {
        tokens: Vec<u32>,
        blocks: Vec<BlockId>,
        /// Tokens whose KV is "computed" (blocks registered up to here).
        done: usize,
        last_hash: u64,
    }

    fn held(seqs: &[Seq]) -> HashMap<BlockId, u32> {
        let mut h = HashMap::new();
        for s in seqs {
            for &b in &s.blocks {
                *h.entry(b).or_insert(0) += 1;
            }
        }
        h
    }

    /// Advance `s` by `n` tokens: allocate blocks as needed, register blocks that became full.
    fn step(m: &mut BlockManager, s: &mut Seq, n: usize) -> bool {
        let bs = m.block_size();
        let target = (s.done + n).min(s.tokens.len());
        let need = m.blocks_for(target).saturating_sub(s.blocks.len());
        match m.allocate(need) {
            Some(b) => s.blocks.extend(b),
            None => return false,
        }
        for blk in s.done / bs..target / bs {
            if (blk + 1) * bs > s.done {
                s.last_hash = m.register_full(
                    s.blocks[blk],
                    s.last_hash,
                    &s.tokens[blk * bs..(blk + 1) * bs],
                );
            }
        }
        s.done = target;
        true
    }

    #[test]
    fn random_interleavings_keep_every_invariant() {
        let (mut hits, mut preempted, mut admitted) = (0u64, 0u64, 0u64);
        for seed in 1..40u64 {
            let mut rng = Rng(seed * 0x9E37_79B9_7F4A_7C15);
            let mut m = BlockManager::new(16, 4);
            let prefixes: Vec<Vec<u32>> = (0..3)
                .map(|p| (0..12).map(|i| p * 100 + i).collect())
                .collect();
            let mut seqs: Vec<Seq> = vec![];
            for _ in 0..400 {
                match rng.below(7) {
                    // admit: a shared prefix plus a random tail, reusing cached blocks
                    0 | 1 => {
                        let mut tokens = prefixes[rng.below(3)][..rng.below(13)].to_vec();
                        tokens.extend((0..1 + rng.below(10)).map(|_| rng.below(50) as u32 + 1000));
                        let pm = m.match_prefix(&tokens, tokens.len() - 1);
                        let mut s = Seq {
                            done: pm.tokens,
                            last_hash: pm.last_hash,
                            blocks: pm.blocks,
                            tokens,
                        };
                        if step(&mut m, &mut s, 1 + rng.below(8)) {
                            admitted += 1;
                            seqs.push(s);
                        } else {
                            m.release(&s.blocks); // could not start: give back what it took
                        }
                    }
                    // step a running sequence (prefill chunk or decode token)
                    2..=5 if !seqs.is_empty() => {
                        let i = rng.below(seqs.len());
                        if seqs[i].done == seqs[i].tokens.len() {
                            let t = rng.below(60) as u32;
                            seqs[i].tokens.push(t);
                        }
                        let n = 1 + rng.below(4);
                        if !step(&mut m, &mut seqs[i], n) {
                            // preempt the newest sequence to make room
                            preempted += 1;
                            let s = seqs.pop().unwrap();
                            m.release(&s.blocks);
                        }
                    }
                    // finish or cancel
                    6 if !seqs.is_empty() => {
                        let s = seqs.swap_remove(rng.below(seqs.len()));
                        m.release(&s.blocks);
                    }
                    _ => {}
                }
                m.check(&held(&seqs))
                    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
            for s in seqs.drain(..) {
                m.release(&s.blocks);
            }
            m.check(&HashMap::new()).unwrap();
            assert_eq!(m.available(), m.total(), "seed {seed}: blocks leaked");
            hits += m.prefix_hits;
        }
        // The interleavings really exercised sharing, reuse and preemption.
        assert!(
            hits > 100 && preempted > 10 && admitted > 500,
            "hits {hits}, preempted {preempted}, admitted {admitted}"
        );
    }

    #[test]
    fn a_repeated_prefix_reuses_the_same_blocks() {
        let mut m = BlockManager::new(8, 4);
        let prompt: Vec<u32> = (0..10).collect();
        let pm = m.match_prefix(&prompt, prompt.len() - 1);
        assert_eq!((pm.tokens, m.prefix_hits), (0, 0));
        let mut s = Seq {
            tokens: prompt.clone(),
            blocks: pm.blocks,
            done: 0,
            last_hash: 0,
        };
        assert!(step(&mut m, &mut s, 10));
        let first = s.blocks.clone();
        m.release(&s.blocks);
        // Same prompt again: the two full blocks come back (the partial third does not).
        let pm = m.match_prefix(&prompt, prompt.len() - 1);
        assert_eq!(pm.tokens, 8);
        assert_eq!(pm.blocks, first[..2].to_vec());
        assert_eq!((m.prefix_queries, m.prefix_hits), (2, 1));
        // A different second block stops the match after the first.
        m.release(&pm.blocks);
        let mut other = prompt.clone();
        other[5] = 99;
        assert_eq!(m.match_prefix(&other, 9).blocks, first[..1].to_vec());
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_used_first() {
        let mut m = BlockManager::new(3, 2);
        let a = m.allocate(1).unwrap();
        let ha = m.register_full(a[0], 0, &[1, 2]);
        let b = m.allocate(1).unwrap();
        m.register_full(b[0], 0, &[3, 4]);
        m.release(&a);
        m.release(&b);
        assert_eq!(m.available(), 3);
        // Needs 2 blocks: the free one, then the older cached one (a).
        let got = m.allocate(2).unwrap();
        assert!(got.contains(&a[0]) && !got.contains(&b[0]));
        assert!(
            m.match_prefix(&[1, 2, 9], 3).blocks.is_empty(),
            "a's content was evicted"
        );
        assert_eq!(m.match_prefix(&[3, 4, 9], 3).blocks, b);
        let _ = ha;
        assert!(m.allocate(1).is_none(), "everything is in use");
    }

    #[test]
    fn hash_collisions_cannot_return_wrong_content() {
        let mut m = BlockManager::new(2, 2);
        let a = m.allocate(1).unwrap();
        let h = m.register_full(a[0], 0, &[5, 6]);
        // Forge an index entry for other content under the same hash: content check refuses it.
        m.index.insert(chain_hash(0, &[7, 8]), a[0]);
        assert!(m.match_prefix(&[7, 8, 1], 3).blocks.is_empty());
        assert_eq!(m.index.get(&h), Some(&a[0]));
    }
}
