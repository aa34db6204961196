"""SGLang as an engine kind: everything the study, the trial and production need of SGLang, in one package.

- `adapter`: `SglangAdapter`, the kind's `Engine` (`serve.engines.engine_for("sglang")`): the replica's `SglangEngine`
  and what a study asks of the kind before anything starts;
- `engine`: the `SglangEngine` (argv, environment, process lifecycle, the resolved config read back);
- `backend`: the attention backend SGLang's engines run on a GPU and whether its verify applies a draft tree's mask;
- `check`, `preflight`, `verdicts`: SGLang's own parser and resolution asked about each command line (in SGLang's
  interpreter), its answers kept on disk;
- `node`: what the GPU node must hold (free GPUs, compilers, environment);
- `study`: what a whole study on SGLang resolves once (the backend, the preflight of the search space);
- `cpu`: SGLang's own server on a CPU machine, from its own venv (stand-in kernels, the torch-native tree verify).

Nothing is imported here: `python -m serve.engines.sglang.cpu` runs in SGLang's venv, which must not import the
engine's pipeline-side modules on the way.
"""
