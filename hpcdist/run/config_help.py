"""What ``--help`` says of each TrainConfig field, grouped as the help prints them
(config.build_parser; config asserts every field is here exactly once)."""

# --help: what each option does, in groups. Every TrainConfig field appears exactly once
# (checked at import).
HELP = {
    "data": {
        "task": "what to learn: sort | reverse (generated digit tasks, exact-match accuracy) "
                "| text (next character of --data)",
        "data": "--task text: a text file, or token shards: a folder from python -m "
                "hpcdist.data prepare, a glob of llm.c shards, a raw uint16 .bin",
        "data_encoding": "its encoding; decoded strictly (bad bytes are an error)",
        "length": "digits per sequence (sort, reverse)",
        "num_digits": "digit alphabet size (sort, reverse)",
        "block_size": "context length in tokens (text)",
        "tokenizer": "text: a Hugging Face tokenizer.json (python -m hpcdist.data prepare "
                     "writes one); default: characters, or the one beside token shards",
        "vocab_size": "text: the vocabulary size of raw uint16 .bin shards (0: from the "
                      "tokenizer)",
        "packing": "chat / instruction shards: bfd packs several documents into a row "
                   "(best-fit decreasing; each attends only to itself, from position 0), off "
                   "gives each its own padded row",
    },
    "model": {
        "model": "a published size, its family and shape (flags given still win): gpt2, "
                 "gpt2-medium, llama3-8b, llama3.2-1b, mistral-7b, qwen2.5-0.5b, gemma-2b, "
                 "... (nn/<family>.py's SIZES; an unknown name lists them all)",
        "arch": "the model family: gpt (GPT-2) | llama (with --experts: Mixtral) | qwen2 | "
                "gemma (nn/<family>.py; each one's own settings are listed under it below)",
        "n_layer": "transformer blocks", "n_head": "attention heads per block",
        "n_embd": "embedding width", "dropout": "dropout probability (0 disables)",
        "vocab_multiple": "pad the token table and the LM head to a multiple of this many "
                          "rows (x the tensor-parallel size), so the head's GEMM is aligned "
                          "for tensor cores: GPT-2's 50,257 -> 50,304 at 64; the padding is "
                          "never sampled, never in the loss, never in checkpoints (0: 64 on "
                          "a GPU, 1 on the CPU, where BLAS gains nothing from it)",
        "bias": "biases in linear layers and norms (rotary families: on the attention's "
                "projections)",
        "tie_weights": "the output head reuses the token embedding",
        "checkpoint_activations": "recompute each block's activations in backward (less "
                                  "memory, one more forward)",
        "init_from": "start from a Hugging Face model folder (config.json + "
                     "model.safetensors: GPT-2, Llama, Mistral, Mixtral, Qwen2, Gemma): its "
                     "family, shape and weights, in any layout; the data must use its "
                     "tokenizer",
        "dtype": "master precision: fp32 | fp64 (fp64 for exactness tests)",
        "device": "cpu | gpu | auto (gpu: one GPU per rank, by node-local rank) | standin "
                  "(the GPU code path on the CPU, for tests: arrays MPI cannot read); "
                  "without it $HPCDIST_DEVICE, else cpu",
    },
    "LoRA (docs/fine-tuning.md)": {
        "lora_rank": "> 0: train low-rank adapters of this rank on the --lora-targets, the "
                     "rest of the model frozen (no gradient, no optimizer state, no "
                     "reduction); 0: every parameter trains",
        "lora_alpha": "the adapters' scale is alpha / rank (alpha / sqrt(rank) with --rslora)",
        "lora_dropout": "dropout on the adapters' input (PEFT's lora_dropout)",
        "lora_targets": "which linears get adapters, by role: q,k,v,o,gate,up,down,experts, "
                        "or all-linear (every linear of a block; never the head)",
        "rslora": "rank-stabilised LoRA: scale alpha / sqrt(rank) (PEFT's use_rslora)",
        "adapter": "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors): "
                   "its rank, alpha, targets and weights, trained on from there",
        "base_dtype": "the frozen base's storage: auto (the compute precision's dtype) | nf4 "
                      "(QLoRA: every block linear's weight in 4-bit NormalFloat, blocks of 64, "
                      "double-quantised scales, dequantised for each GEMM)",
    },
    "experts": {
        "experts": "experts per MoE layer (0: dense MLPs everywhere)",
        "top_k": "experts each token is sent to",
        "moe_every": "an MoE MLP in every n-th block, from block 0",
        "router": "softmax (GShard/Switch; top-k > 1 renormalised) | sigmoid (DeepSeek-V3)",
        "shared_experts": "always-on expert MLPs beside the routed ones",
        "expert_hidden": "each expert's (and shared expert's) MLP width (0: 4 x n_embd, as "
                         "the dense MLP; smaller for fine-grained experts, as DeepSeek's)",
        "capacity_factor": "> 0: an expert keeps ceil(tokens x top-k x factor / experts) "
                           "assignments, the latest in token order dropped; 0: dropless",
        "aux_loss_coef": "weight of the Switch load-balancing loss (balance aux)",
        "z_loss_coef": "weight of the z-loss on the router logits (0: off)",
        "balance": "aux (the Switch loss) | bias (DeepSeek-V3's auxiliary-loss-free bias, "
                   "with --router sigmoid) | none",
        "bias_rate": "balance bias: b += rate x sign(mean load - load) each step",
        "ep": "expert-parallel size: each MoE layer's experts split over ep ranks, tokens "
              "moved by all-to-all (folds over data parallelism)",
    },
    "optimisation": {
        "steps": "optimizer steps", "batch_size": "sequences per data-parallel replica per "
                                                  "micro-batch",
        "grad_accum": "micro-batches per step (gradients communicated on the last only)",
        "optimizer": "adamw | sgd", "lr": "peak learning rate", "min_lr": "final learning "
                                                                          "rate (cosine decay)",
        "warmup": "linear warm-up steps", "weight_decay": "decoupled weight decay (matrices)",
        "beta1": "AdamW beta1", "beta2": "AdamW beta2", "momentum": "SGD momentum",
        "grad_clip": "clip the global gradient norm to this (0 disables)",
        "scale_lr": "multiply lr by the number of data-parallel replicas",
        "precision": "compute precision fp32 | fp16 | bf16 | fp8 (fp32 master weights; fp8: "
                     "bf16 with the linear layers' GEMMs on e4m3 / e5m2 codes, per-tensor "
                     "scales: cuBLASLt's FP8 matmul on a GPU with FP8 tensor cores (H100, "
                     "H200, B200), an exact emulation on the CPU)",
        "tf32": "fp32 GEMMs on TF32 tensor cores (GPU with compute capability 8 or more; "
                "10-bit mantissa inputs, fp32 accumulation; no effect on the CPU)",
        "loss_scale": "fp16: initial dynamic loss scale", "seed": "seed of the model and data",
        "attention": "attention's implementation: auto (the fastest that can run, measured on "
                     "the run's shape on a GPU) | flash (tiled, every device) | gemms (GPU: "
                     "cuBLAS around the fused softmax, T x T kept; auto weighs it up to T = 14 x "
                     "the head size) | cudnn (GPU, bf16: "
                     "cuDNN's fused attention, pip install 'hpcdist[cudnn]')",
        "cuda_graph": "off | on (the flag alone) | auto: the step recorded once as a CUDA "
                      "graph and replayed (GPU: the host's ~40 us a launch leave the step). "
                      "One replica, or several over --backend nccl: the whole step, "
                      "AdamW's learning rate on the device; several over MPI: each "
                      "micro-batch's forward and backward, gradients averaged after it. "
                      "auto times the first steps both ways and keeps the faster "
                      "(and runs eagerly what a graph cannot hold). Dense models without "
                      "dropout, one model replica a rank; no effect on the CPU",
    },
    "parallelism": {
        "tp": "tensor-parallel size: heads, MLP width and vocabulary split over tp neighbouring "
              "ranks (data-parallel size = world / tp)",
        "sequence_parallel": "with --tp: split LayerNorm/dropout activations along the sequence",
        "pp": "pipeline stages: the blocks split over pp ranks (data-parallel size = world / "
              "(tp x pp))",
        "micro_batches": "micro-batches each batch is split into in the pipeline (0: 2 x pp)",
        "schedule": "pipeline schedule: gpipe | 1f1b | interleaved | zb-h1 (verified before "
                    "any micro-batch moves)",
        "virtual_stages": "model chunks per rank (--schedule interleaved)",
        "pp_split": "blocks per stage, e.g. 2,2,1 (default: as even as possible)",
        "cp": "context-parallel size: each sequence split over cp ranks, attention too "
              "(data-parallel size = world / (tp x pp x cp))",
        "cp_impl": "context parallelism through attention: ring (K/V blocks round the group) "
                   "| ulysses (all-to-all, heads <-> sequence; cp must divide n_head / tp)",
        "zero": "ZeRO level 0 (plain DDP) | 1 (optimizer state) | 2 (+ gradients) | 3 (+ "
                "parameters), sharded over the data-parallel group",
        "strategy": "collective (DDP, ZeRO, TP, PP) | ps: asynchronous parameter servers | "
                    "diloco: replica groups that meet every --inner-steps",
        "shard_group": "with --zero: shard over all data-parallel ranks, or over each node "
                       "(groups of --shard-size), replicated across them (hybrid sharding)",
        "shard_size": "--shard-group node: ranks in each shard group (0: one node's)",
        "servers": "ps: how many of the last ranks are servers (each holds a shard of the "
                   "parameters and optimizer)",
        "max_staleness": "ps: a worker waits while it is this many clocks ahead of the "
                         "slowest (0: synchronous, equals DDP; -1: never)",
        "bucket_mb": "gradient bucket size in MB", "first_bucket_mb": "the first (last "
                                                                     "layers') bucket, smaller",
        "overlap": "average buckets during backward", "backend": "mpi | nccl (GPU gradients)",
        "compress": "gradient compression: none | fp16 | topk (DGC) | powersgd",
        "density": "topk: fraction of each bucket sent",
        "compress_momentum": "topk: DGC momentum correction (the optimizer runs without)",
        "compress_clip": "topk: local gradient clipping norm (0 disables)",
        "density_warmup": "topk: steps of DGC's exponential density warm-up",
        "powersgd_rank": "powersgd: rank r of each gradient matrix's approximation (sends "
                         "r(n+m) values for n x m; 4 holds the default task's accuracy, 1 "
                         "lost 12 points; --rank is the old spelling)",
        "powersgd_start": "powersgd: average densely for this many steps first",
        "timeout": "seconds any rank may wait on another before the job ends with a report "
                   "naming who did not arrive (0: $HPCDIST_TIMEOUT, else 300)",
        "on_failure": "a rank that dies: abort ends the job (requeue and --resume); shrink "
                      "goes on without it in the same job (Open MPI's ULFM; docs/failures.md)",
        "respawn": "after a shrink: the survivors start one process per rank lost "
                   "(MPI_Comm_spawn), which joins at the recovery and takes the state from "
                   "rank 0 over MPI: the job keeps its size. Launch with mpirun --prtemca "
                   "state_base_recoverable 1 --prtemca state_base_notify_errors 1 as well: "
                   "Open MPI makes a spawned job recoverable only so",
        "mirror_every": "--on-failure shrink with sharded state (ZeRO, TP, PP, CP, EP): "
                        "every K committed steps each rank's state goes to a buddy's memory, "
                        "so a lost rank costs at most K - 1 steps, not a save interval "
                        "(0: off; the survivors restore the last checkpoint)",
        "shrink_batch": "after a shrink: scale the global batch with the ranks left (each "
                        "keeps --batch-size), or keep it (each rank's batch grows, where it "
                        "divides)",
    },
    "low-communication training (DiLoCo; docs/diloco.md)": {
        "group_size": "diloco: ranks in each replica group (0: the ranks of one node); DDP, "
                      "ZeRO or TP runs inside a group",
        "inner_steps": "diloco: H, inner optimizer steps between the groups' meetings",
        "outer_lr": "diloco: the outer SGD's learning rate on the averaged pseudo-gradient "
                    "(1 with --outer-momentum 0: federated averaging)",
        "outer_momentum": "diloco: the outer SGD's momentum", "outer_nesterov":
        "diloco: Nesterov momentum outside (the paper's choice)",
        "fragments": "streaming DiLoCo: the model in F fragments meeting in turn, H/F steps "
                     "apart (1: all at once)",
        "outer_overlap": "diloco: inner steps a fragment's exchange runs behind, non-blocking "
                         "(0: the group waits for it); less than H / fragments",
        "outer_wire": "diloco: the pseudo-gradients on the wire: fp32 (the master dtype) | "
                      "fp16 | bf16 | int8 | int4 (a scale per 256 values)",
        "outer_mix": "diloco with --outer-overlap: the local fragment's weight when the "
                     "average lands (Streaming DiLoCo's alpha)",
    },
    "checkpoints": {
        "save_dir": "where checkpoints go (none without it)",
        "save_every": "steps between checkpoints (0: only at the end)",
        "keep_last": "keep only the newest N checkpoints, removing older ones after each save "
                     "(0: keep all)",
        "resume": "continue from the newest verified checkpoint in --save-dir",
        "overwrite": "a fresh run into a --save-dir that holds another run's checkpoints "
                     "moves them aside to <dir>.old-N (never deletes); without it that is "
                     "refused",
        "async_save": "copy a checkpoint's state to host memory in the step and write it "
                      "from a background thread while training goes on (one in flight at "
                      "most; the last, and a SIGTERM's, written in the step)",
        "allow_other_files": "write checkpoints into a --save-dir that holds files no run "
                             "wrote (refused without it, naming one; the training data's "
                             "folder is never a save folder)",
    },
    "observability": {
        "log_every": "print a progress line every N steps (metrics.jsonl records every step)",
        "eval_every": "held-out loss and accuracy every N steps, printed and in "
                      "metrics.jsonl (0: at the end only)",
        "eval_batch": "sequences an evaluation forward takes at most (fewer at long "
                      "context: at most max(--batch-size, 16,384 / T))",
        "eval_tokens": "held-out tokens scored at most: windows (or digit examples) of T "
                       "tokens, evenly spaced, up to 4,096 and to an eighth of the sequences "
                       "the run trains on, every replica's (0: 4,096 windows)",
        "out_dir": "metrics.jsonl, train.log (what "
                                                          "rank 0 prints), ranks.json, "
                                                          "comm_log.json go here",
        "tensorboard": "also write metrics.jsonl's records as TensorBoard event files in "
                       "<out-dir>/tensorboard (tensorboardX; tensorboard --logdir <out-dir>)",
        "wandb": "also log metrics.jsonl's records to a Weights & Biases run (offline into "
                 "<out-dir>/wandb unless $WANDB_MODE says otherwise; needs wandb)",
        "trace": "write a Chrome trace of every rank to this file (ui.perfetto.dev)",
        "comm_log": "print per-collective timings beside the alpha-beta model",
        "trace_memory": "measure each step's activation memory and peak above the model "
                        "state (CPU: tracemalloc, slower)",
        "straggler": "RANK:MS: that rank sleeps MS milliseconds in every step (a slow worker)",
        "allow_singletons": "run even where the launcher's environment promises N tasks but "
                            "MPI started a world of 1 (refused by default: a launcher/MPI "
                            "mismatch makes N separate 1-rank runs)",
    },
}
