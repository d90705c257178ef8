"""What a norm layer is, saved with its weights, so that the weights of one norm never load silently into
another.

Tensors alone do not say which normalization used them: GN and PONO both have only ``weight`` and
``bias``, BNSR has BatchNorm's tensors, and GN's group count or a layer's eps has no shape at all. So
every layer of this package saves its identity in its state dict (torch's ``get_extra_state``, under
``<module>._extra_state``): the class that defines its computation and the options that change what it
computes. Loading a state dict whose identity differs fails, naming the module and both identities, on
every path that loads state dicts (``load_state_dict``, detectron2's checkpointers and so
``DefaultPredictor``). A state dict without identities (converted or foreign weights, which know no
options) loads as before, unchecked and with no warning; detectron2's loaders cannot tell such a file from
one of another norm, so ``d2.checkpointer`` requires the identities when it evaluates or resumes.

- Not part of the identity: options that only set where training starts or how fast the running
  estimates move (momentum, DN's initial gates), which a trained state does not depend on.
- SyncSN's identity is SN's: the same tensors and the same computation in evaluation.
- TorchScript compiles neither method: a scripted layer's state dict has no identity.
- It is stored as a fixed-size uint8 tensor (UTF-8, zero-padded), because detectron2's loader compares
  every entry's shape first and would skip one of another shape with a warning, never reaching the check.
"""

import torch
from torch import Tensor

_NOT_IDENTITY = frozenset({"momentum", "init_groups", "init_batch_pool"})
_SIZE = 256  # bytes; fixed forever, see the module docstring
IDENTITY_KEY = "_extra_state"  # where torch saves get_extra_state(), after the module's prefix


class NormIdentity:
    """Mixin of every layer of this package, first among its bases: saves and checks its identity."""

    def norm_identity(self) -> str:
        """The class defining this layer's computation (the one that declares its ``option_rules``) with
        the options that change it, e.g. ``GroupNorm2d(eps=1e-05, num_groups=32)``."""
        defining = next(cls for cls in type(self).__mro__ if "option_rules" in vars(cls))
        options = [f"{name}={getattr(self, name)!r}" for name in sorted(defining.option_rules) if name not in _NOT_IDENTITY]
        return f"{defining.__name__}({', '.join(options)})"

    def get_extra_state(self) -> Tensor:
        data = self.norm_identity().encode()
        if len(data) > _SIZE:
            raise ValueError(f"the identity {data!r} is longer than the {_SIZE} bytes a checkpoint stores")
        return torch.tensor(list(data.ljust(_SIZE, b"\0")), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Nothing to set: ``_load_from_state_dict`` has checked the identity, where it knows the module's name."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        key = prefix + IDENTITY_KEY
        if key in state_dict:
            saved, own = _decode(state_dict[key]), self.norm_identity()
            if saved != own:
                errors.append(f"{prefix[:-1] or 'the layer'} is {own}, but the state dict was saved by {saved}: "
                              "load it into a model built with that norm and those options")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        if key in missing:  # weights without an identity load unchecked (module docstring)
            missing.remove(key)


def _decode(state) -> str:
    if not (isinstance(state, Tensor) and state.dtype == torch.uint8 and state.shape == (_SIZE,)):
        return f"an unreadable identity ({type(state).__name__} {getattr(state, 'shape', '')})"
    return bytes(state.tolist()).rstrip(b"\0").decode(errors="replace")
