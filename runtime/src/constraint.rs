//! Rules on what a request's output may be (JSON mode, `json_mode.rs`), as the engine applies
//! them: before each sample the rule says which tokens may come, the rest of the row is masked
//! to -inf, and the request ends (reason `stop`) when the rule says the output is complete.

use crate::sampling::Sampler;

/// A rule on what a request's output may be (JSON mode, say): which tokens may come next, and
/// when the output is complete. The engine masks the logits with it before sampling, advances
/// it with each token, and ends the request (reason `stop`) once it is complete.
pub trait Constraint: Send {
    /// Sets `allowed[id]` (one entry per vocabulary token) for each token that may come next.
    fn allowed(&mut self, allowed: &mut [bool]);
    /// Moves past `id`.
    fn advance(&mut self, id: u32);
    /// Whether the output is complete.
    fn complete(&self) -> bool;
    fn clone_box(&self) -> Box<dyn Constraint>;
}

impl Clone for Box<dyn Constraint> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

impl std::fmt::Debug for dyn Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// Samples from `row` with every token `c` does not allow masked out; `None` if it allows none.
pub(crate) fn constrained(
    sampler: &mut Sampler,
    c: &mut dyn Constraint,
    row: &[f32],
) -> Option<u32> {
    let mut allowed = vec![false; row.len()];
    c.allowed(&mut allowed);
    if !allowed.contains(&true) {
        return None;
    }
    let masked: Vec<f32> = row
        .iter()
        .zip(&allowed)
        .map(|(&v, &a)| if a { v } else { f32::NEG_INFINITY })
        .collect();
    let id = sampler.sample(&masked);
    // Sampling never picks a masked token unless every allowed one is -inf or NaN itself.
    Some(if allowed[id as usize] {
        id
    } else {
        allowed.iter().position(|&a| a)? as u32
    })
}
