"""Other systems' APIs as thin faces over fullshard's core, each module named after the system it
mirrors; none adds logic of its own. This package's `__init__` imports none of them, so the
engine can read `llamafactory` (it sits in the engine's layer) without pulling in the others.

- `llamafactory`: LLaMA-Factory's FSDP2 plugin forms (`FSDP2Engine(dict, bf16=)`, its `PluginConfig`
  and `FSDP2Params`) as `EngineConfig` values, read by `EngineConfig.from_any`
- `lightrft`: LightRFT's `FSDPV2Strategy` (`FSDPStrategy`) and `save_ckpt` / `load_ckpt` / `save_model`
- `transformers`: transformers' `apply_fsdp2(model, device_mesh, fsdp_plan)`
"""
