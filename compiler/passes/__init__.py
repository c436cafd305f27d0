"""Graph rewrites of the compiler's stages, run in order by `model_pipeline.rewrite` (the one
list of them). A rewrite is `pass(graph, *what it reads) -> count`: it edits the graph in
place and returns how many places it changed, which the compile report shows. What else it
reads comes after the graph (the contract, the role, the probed samples, max_seq_len). Two
exceptions: `fuse_rotary` also returns the rotaries it left unfused, with the reason for
each, and the checks (`check_per_token_positions`, the span probe in span.py) return
nothing and raise, naming the layer and the node, where the model cannot compile exactly.
Analyses (attention.py, span.py, probe.py) find what the rewrites act on."""
