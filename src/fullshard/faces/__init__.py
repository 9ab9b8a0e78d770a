"""Other systems' APIs as thin faces over fullshard's core, each module named after the system it
mirrors; none adds logic of its own. LLaMA-Factory's FSDP2 plugin forms (`FSDP2Engine(dict)`, its
`PluginConfig` and `FSDP2Params`) are read by `EngineConfig.from_any` itself.

- `lightrft`: LightRFT's `FSDPV2Strategy` (`FSDPStrategy`) and `save_ckpt` / `load_ckpt` / `save_model`
- `transformers`: transformers' `apply_fsdp2(model, device_mesh, fsdp_plan)`
"""
