"""Token sampling with sampling masks for RL rollouts, served by Triton's Python backend.

Subpackages, each depending only on those listed before it:

- `sampling`: the math (parameters, rules, seeded noise, the batched sampler, backends); torch only.
- `generation`: the causal-LM plugin interface and the generation loop; no Triton.
- `client`: what a trainer imports (typed client, `SamplingParams`, converters, replay).
- `serving`: the Triton glue the `model.py` files call (everything that touches `pb_utils`).
- `ops`: the launcher, the supervisor and the GPU repository derivation.

`model_config` (reading a model's config.pbtxt as JSON) is shared by `serving` and `client`.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Import paths documented before the subpackages existed (README, bench/README, user scripts):
# old module name -> where it lives now. Both names give the same module object.
MOVED_MODULES = {
    "converters": "client.converters",
    "replay": "client.replay",
    "sampling_params": "client.sampling_params",
    "sampler": "sampling.sampler",
    "launcher": "ops.launcher",
    "gpu_repository": "ops.gpu_repository",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `triton_sampling_mask.<old>` to the moved module, for `import` and `python -m`."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        moved = importlib.util.find_spec(f"{__name__}.{MOVED_MODULES[name]}")
        return importlib.util.spec_from_loader(fullname, self, origin=moved.origin) if moved else None

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system overwrites __spec__; put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname):
        moved = importlib.util.find_spec(f"{__name__}.{MOVED_MODULES[fullname.rpartition('.')[2]]}")
        return moved.loader.get_code(moved.name)


sys.meta_path.append(_MovedModuleFinder())
