"""Memory: a stage takes work only once its bytes are admitted, and an out-of-memory
error splits the work instead of losing it.

Modules, in the order a micro-batch meets them:
- ``readings``: what this process holds, may still allocate, and its peak (CPU, cgroup, CUDA);
- ``admission``: estimate a micro-batch's bytes, then admit, defer or split it (a pure
  state machine, ``AdmissionController``);
- ``guard``: ``MemoryGuard`` drives the controller on a stage's event loop (waits out a
  deferral, runs the pieces of a split, releases what was admitted, measures peaks);
- ``oom``: recognise an out-of-memory error and recover by halving the piece that failed;
- ``splitting``: cut a micro-batch into pieces of whole GRPO groups and merge them back;
- ``packing``: group a piece's rows into passes by a token budget (longest first).

One word per concept, here and in the stages that use this package:
- **micro-batch**: what one queue edge carries (a ``PromptBatch`` or ``RolloutBatch``),
  and the unit a stage asks admission for;
- **piece**: a run of whole GRPO groups cut from a micro-batch, by an admission SPLIT or
  by halving after an OOM; every sample lands in exactly one piece, and a stage merges
  the pieces' results back into one micro-batch (the trainer accumulates them into one
  step). A piece is admitted, measured and retried like a micro-batch;
- **chunk** (or **pass**): the samples one forward (and backward) pass of an engine
  takes inside a piece: rows of similar length up to ``train.pass_tokens`` padded
  tokens, or ``chunk_size`` consecutive samples with it 0; passes bound activation
  memory and never leave the engine;
- **group**: the ``group_size`` samples of one prompt; the smallest piece there is.
"""
