"""Which submodule a policy is for, inside the module a framework hands over.

A policy is tuned on the model ``get_model()`` returns; a framework hands over the module that
holds it (a ``LightningModule`` with ``self.model = ...``, a Trainer's model with a head). Its names
are relative to the tuned model, so it is installed on that submodule: the one named by
``module=``, else the one whose structure fingerprint (module paths and types, parameter names and
shapes, as :func:`autoprec.runtime.apply.structure_fingerprint` hashes them) is the one ``autoprec tune``
recorded in ``policy.model["structure"]``. It is never applied under shifted names: a policy's
``re:`` patterns could match a wrapper's paths while its default would sit on a forward the
framework never calls.
"""

from __future__ import annotations

import difflib
import warnings

from torch import nn

from autoprec.runtime.apply import applied_mode, applied_policy, apply_policy, remove_policy, structure_fingerprint
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.rulecheck import half_precision_parameters

__all__ = ["FirstRunCheck", "install_for_training"]


def install_for_training(model: nn.Module, policy: Policy, module: str | None = None, *,
                         root_forward_runs: bool = True, owner: str = "autoprec") -> tuple[str, nn.Module]:
    """Apply ``policy`` for training to the submodule of ``model`` it is for; return its path and the submodule.

    ``module``: the submodule's path ("" for ``model`` itself); by default, the submodule whose
    structure matches the policy's record. A policy without a record (written by hand) goes on
    ``model`` itself when ``root_forward_runs`` (the framework calls ``model``'s forward), else it
    needs ``module=``. Frameworks set up again on each ``fit``/``validate``/``test``/``train()``, often
    with a new plugin or callback that loaded the same file again: a submodule that already runs an
    equal policy keeps it (re-applied for training if it was applied for inference); another policy
    is refused in one line.
    """
    name, target = _find(model, policy, module, root_forward_runs, owner)
    _check_master_weights(target, name, owner)
    applied = applied_policy(target)
    where = repr(name) if name else f"the {type(model).__name__}"
    if applied is not None and applied != policy:
        raise PolicyError(f"{owner}: {where} already runs another policy (applied by an earlier Trainer, plugin "
                          f"or apply_policy); pass that same policy, or call autoprec.remove_policy on it first")
    if applied is not None and applied_mode(target) != "training":
        remove_policy(target)  # an inference install may cache quantized weights that training would leave stale
        applied = None
    if applied is None:
        apply_policy(target, policy, mode="training")
    return name, target


def _check_master_weights(target: nn.Module, name: str, owner: str) -> None:
    """Training with a policy keeps fp32 master weights: a model loaded or cast in half precision has none
    (fp16 gradients cannot even be unscaled), so it is refused before anything changes."""
    low = half_precision_parameters(target)
    if low:
        (first, dtype) = low[0]
        where = f"{name!r}" if name else f"the {type(target).__name__}"
        raise PolicyError(f"{owner}: {len(low)} parameters of {where} are {str(dtype).removeprefix('torch.')} "
                          f"(e.g. {first!r}), so training would have no fp32 master weights; load or build the "
                          "model in fp32 (from_pretrained(..., dtype=torch.float32), no .half()) and let the policy "
                          "decide each layer's compute precision")


def _find(model: nn.Module, policy: Policy, module: str | None, root_forward_runs: bool,
          owner: str) -> tuple[str, nn.Module]:
    kind = type(model).__name__
    if module is not None:
        names = [n for n, _ in model.named_modules()]
        if module not in names:
            close = difflib.get_close_matches(module, names, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise PolicyError(f"{owner}(module={module!r}): the {kind} has no submodule {module!r}{hint}")
        return module, model.get_submodule(module)
    recorded, recorded_type = policy.model.get("structure"), policy.model.get("type")
    if recorded is None:
        if root_forward_runs:
            return "", model
        raise PolicyError(f"{owner}: this policy records no model structure (written by hand?), so which submodule "
                          f"of the {kind} it is for is unknown; name it: {owner}(policy, module='model')")
    found = [(n, m) for n, m in model.named_modules()
             if (recorded_type is None or _is_a(m, recorded_type)) and structure_fingerprint(m) == recorded]
    if len(found) == 1:
        return found[0]
    if found:
        listed = ", ".join(repr(n) for n, _ in found)
        raise PolicyError(f"{owner}: the policy fits {len(found)} submodules of the {kind} ({listed}); "
                          f"name the one to train with it: {owner}(policy, module={found[0][0]!r})")
    same_type = [repr(n) for n, m in model.named_modules() if _is_a(m, recorded_type)]
    hint = (f"; its {recorded_type} ({', '.join(same_type[:3])}) has other layers or shapes: tune that model, "
            f"or name it with module= to apply the policy anyway" if same_type else
            "; name the submodule it is for with module=, or tune the model you train")
    raise PolicyError(f"{owner}: no submodule of the {kind} is the model this policy was tuned on "
                      f"(a {recorded_type or 'model'} with {policy.model.get('layers', '?')} tunable layers){hint}")


def _is_a(module: nn.Module, type_name: str | None) -> bool:
    """Whether ``module`` is of the class named, or of a subclass a wrapper made of it (FSDP2's ``fully_shard``
    turns a Sequential into an FSDPSequential, as Lightning's ModelParallelStrategy does before plugins run)."""
    return any(cls.__name__ == type_name for cls in type(module).__mro__)


class FirstRunCheck:
    """Warns once when the policy's submodule did not run in the first training step (the policy did nothing)."""

    def __init__(self, target: nn.Module, name: str, owner: str) -> None:
        self.ran = False
        self.message = (f"{owner}: the policy is installed on {name or 'the model'!r}, which did not run in the "
                        f"first training step, so the policy changed nothing; call that module in the step, "
                        f"or name the module that runs with module=")
        self._hook = target.register_forward_pre_hook(self._seen)

    def _seen(self, *_: object) -> None:
        self.ran = True

    def done(self) -> None:
        """Call after the first step: warns if the submodule never ran, then stops watching."""
        if self._hook is None:
            return
        self.close()
        if not self.ran:
            warnings.warn(self.message, stacklevel=3)

    def close(self) -> None:
        """Stop watching, without a word (the watched module will not train)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
