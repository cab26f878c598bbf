"""The engine: one group's sparsifier (no Lightning), its checkpoint state, optimizer-state
masking, sharded tensors, threads for mask updates, and the fit-start table and end-of-fit
summary."""
