//! The speculative selector of specrag (SpecCache): runs a small model over the assembled
//! prompt, scores chunk tokens by the mean L2 norm of its deep-layer hidden states, completes the
//! selection into spans under a global budget and maps it onto the target model's tokens.
//!
//! Status: not implemented yet (issue 4). The crate exists so the workspace has its final shape;
//! it exports nothing.
