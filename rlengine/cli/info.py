"""`rlengine info`: presets, devices, the C++ extension's ops, attention backends; with --plan a training
config's per-device memory plan, with --kernels a model's CPU kernel choices (the CLI's other commands
are in cli.py)."""

from __future__ import annotations

import dataclasses


def cmd_info(args) -> int:
    import torch

    from rlengine.model import ext as _ext
    from rlengine.model.config import PRESETS, preset

    if args.overrides and not args.plan:
        from rlengine.model.config import ConfigError

        raise ConfigError(f"{args.overrides[0]}: config overrides need --plan CONFIG (they change that config)")
    if args.kernels:  # the CPU kernel choices of a model's decode shapes (model/kernel_choice.py)
        from rlengine.benchmarks.kernel_table import kernels_info

        return kernels_info(args.kernels, args.kernels_dtype, args.cpu_kernels, args.save)
    if args.plan:  # the per-device memory plan of a training config, and its B_KV
        from rlengine.analysis.memory_plan import GiB
        from rlengine.model.config import ConfigError
        from rlengine.plan.preflight import check_model
        from rlengine.rl.config import load_job_config
        from rlengine.plan.memory import device_memory, job_shape, plan_job, sequences_per_rank
        from rlengine.plan.specs import resolve_learner, resolve_rollout

        if args.device_memory is not None and not args.device_memory > 0:
            raise ConfigError(f"--device-memory must be > 0 GiB, got {args.device_memory}")
        cfg = load_job_config(args.plan, args.overrides)  # gsm8k: --model.name DIR
        check_model(cfg.model.name, "model.name", cfg.model.revision)
        mem, source = (int(args.device_memory * GiB), "--device-memory") if args.device_memory else device_memory()
        cuda = args.device_memory is not None or torch.cuda.is_available()
        plan = plan_job(cfg, job_shape(cfg), device_bytes=mem, device_type="cuda" if cuda else "cpu")
        print(f"memory plan of {args.plan} ({cfg.model.name}, {cfg.model.dtype}; device memory from {source}):")
        print("\n".join("  " + line for line in plan.lines()))
        if not cfg.train.micro_batch:
            print(f"  train.micro_batch = 0: micro-batches of {plan.micro_batch} sequences (of "
                  f"{sequences_per_rank(cfg)}), the largest the plan fits")
        micro = cfg.train.micro_batch or (plan.micro_batch if plan.micro_batch < sequences_per_rank(cfg) else 0)
        from rlengine.model.fused_decode import describe

        print(describe(cfg.gen.decode_kernels, "cuda" if cuda else "cpu"))
        print("resolved specs (plan.json of a run on this device holds these with its engines'):")
        for name, spec in (("rollout", resolve_rollout(cfg)), ("learner", resolve_learner(cfg, micro))):
            values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "options"}
            print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
        return 0

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    for line in _ext.status_lines():  # both extensions, with the recorded build error of a failed one
        print(line)
    if _ext.AVAILABLE:
        cuda_ops = [op for op in _ext.CPP_OPS if _ext.has_cuda_op(op)]
        print(f"  CPU ops: {', '.join(op for op in _ext.CPP_OPS if _ext.has_op(op))}")
        print(f"  CUDA ops: {', '.join(cuda_ops) if cuda_ops else 'none (a CPU build of torch, or no nvcc)'}")
    from rlengine.engine.attention import AUTO_ORDER, BACKENDS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"attention backends on {device}:")
    for name, cls in BACKENDS.items():
        reason = cls.unavailable_reason(device) if hasattr(cls, "unavailable_reason") else None
        print(f"  {name:10s} {'available' if reason is None else 'unavailable: ' + reason}")
    print(f"  auto picks the first available of {' > '.join(AUTO_ORDER[device.type])} (flashinfer: opt-in)")
    graphs = "on by default (enforce_eager=True turns them off)" if device.type == "cuda" else "off (no CUDA device)"
    print(f"decode CUDA graphs: {graphs}")
    from rlengine.model.fused_decode import DEFAULT_DECODE_KERNELS, describe

    print(describe(DEFAULT_DECODE_KERNELS, device.type) + "; gen.decode_kernels / LLM(decode_kernels=) = torch|fused")
    from rlengine.telemetry.nvml import NvmlSampler

    nvml = NvmlSampler.for_device(device)  # a training run prints this only when it asked for a GPU
    print(f"GPU telemetry: NVML device(s) {nvml.devices}" if nvml.available else nvml.reason)
    nvml.close()
    print("presets:")
    for name in PRESETS:
        cfg = preset(name)
        kind = f"{cfg.hf_model_type} " + (f"MoE E={cfg.num_experts} K={cfg.num_experts_per_tok}" if cfg.is_moe else "dense")
        print(f"  {name:16s} L={cfg.num_hidden_layers} C={cfg.hidden_size} H={cfg.num_attention_heads} "
              f"Hkv={cfg.num_key_value_heads} D={cfg.head_dim} V={cfg.vocab_size} {kind}")
    return 0
