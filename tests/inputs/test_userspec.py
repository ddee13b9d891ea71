"""Loading model.py: a good file works; every bad one gives one line naming the file, the
function and the fix."""

from __future__ import annotations

import math
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec.inputs.userspec import (
    ModelDataError,
    UserCodeError,
    UserSpec,
    call_model,
    check_fp32_model,
    load_model_py,
    run_evaluate,
    to_device,
)

BAD = Path(__file__).parents[1] / "bad_model_py"

# file in tests/bad_model_py -> (the function the message names, words the message must contain)
BAD_FILES = {
    "missing_get_model.py": ("get_model()", "not defined"),
    "missing_get_batches.py": ("get_batches()", "not defined"),
    "get_model_returns_dict.py": ("get_model()", "returned an OrderedDict, not a torch.nn.Module"),
    "get_model_raises.py": ("get_model()", "raised FileNotFoundError"),
    "get_batches_returns_tensor.py": ("get_batches()", "returned a Tensor, not a list"),
    "get_batches_raises.py": ("get_batches()", "raised KeyError: 'validation' (line 12)"),
    "get_batches_empty.py": ("get_batches()", "returned an empty list"),
    "batch_is_not_a_tensor.py": ("get_batches()", "batch 0 is a list"),
    "one_batch.py": ("get_batches()", "held out"),
    "batches_dont_fit.py": ("get_batches()", "mat1 and mat2 shapes cannot be multiplied (2x5 and 4x2)"),
    "syntax_error.py": ("import", "syntax error (line 7)"),
    "raises_at_import.py": ("import", "No module named 'helpers_that_do_not_exist' (line 3)"),
    "evaluate_returns_string.py": ("evaluate()", "returned a str"),
    "evaluate_raises.py": ("evaluate()", "raised ValueError: too many values to unpack"),
    "evaluate_not_callable.py": ("evaluate()", "not a function"),
    "higher_is_better_yes.py": ("HIGHER_IS_BETTER", "is 'yes', not a bool"),
}

GOOD = '''
import torch
from torch import nn

from helpers import make_batches  # a sibling module

HIGHER_IS_BETTER = False


def get_model():
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def get_batches():
    return make_batches()


def evaluate(model, batches):
    return sum(model(x).pow(2).mean().item() for x in batches) / len(batches)
'''

HELPERS = '''
import torch


def make_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=generator) for _ in range(6)]
'''


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    write(tmp_path, "helpers.py", HELPERS)
    return write(tmp_path, "model.py", GOOD)


def test_enough_bad_files() -> None:
    assert sorted(p.name for p in BAD.glob("*.py")) == sorted(BAD_FILES)


@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_model_py(name: str) -> None:
    function, words = BAD_FILES[name]
    with pytest.raises(UserCodeError) as info:
        load_model_py(BAD / name)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(BAD / name) + f": {function}: ")
    assert words in message
    assert "; fix: " in message
    assert info.value.function == function


def test_user_code_error_pickles() -> None:
    error = UserCodeError("model.py", "get_model()", "not defined", "add it")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) == "model.py: get_model(): not defined; fix: add it"
    assert again.function == "get_model()"


def test_good_model_py(good: Path) -> None:
    spec = load_model_py(good)
    assert isinstance(spec, UserSpec) and isinstance(spec.model, nn.Linear)
    assert spec.path == good.resolve()
    assert len(spec.search_batches) == 4 and len(spec.holdout_batches) == 2  # ceil(6 * 0.25) = 2
    assert spec.batches == spec.search_batches + spec.holdout_batches
    assert spec.higher_is_better is False
    metric = run_evaluate(spec, spec.model, spec.holdout_batches)
    assert isinstance(metric, float) and math.isfinite(metric)
    assert str(good.parent) not in sys.path  # the folder is on sys.path only while user code runs


@pytest.mark.parametrize(("n", "fraction", "holdout"), [(2, 0.25, 1), (4, 0.25, 1), (5, 0.25, 2), (10, 0.5, 5),
                                                       (3, 0.9, 2), (8, 0.01, 1)])
def test_holdout_split(tmp_path: Path, n: int, fraction: float, holdout: int) -> None:
    path = write(tmp_path, "model.py", f"""
        import torch
        from torch import nn

        def get_model():
            return nn.Linear(4, 2)

        def get_batches():
            return [torch.full((1, 4), float(i)) for i in range({n})]
    """)
    spec = load_model_py(path, holdout_fraction=fraction)
    assert len(spec.holdout_batches) == holdout
    assert [int(b[0, 0]) for b in spec.batches] == list(range(n))  # the last ones are held out
    assert spec.evaluate is None and spec.higher_is_better is True


def test_bad_holdout_fraction(good: Path) -> None:
    with pytest.raises(ValueError, match="holdout_fraction"):
        load_model_py(good, holdout_fraction=1.0)


def test_missing_and_non_python_files(tmp_path: Path) -> None:
    with pytest.raises(UserCodeError, match="no such file"):
        load_model_py(tmp_path / "nope.py")
    with pytest.raises(UserCodeError, match=r"not a Python file \(.txt\)"):
        load_model_py(write(tmp_path, "model.txt", "x = 1\n"))


def test_check_false_skips_running_the_model() -> None:
    spec = load_model_py(BAD / "batches_dont_fit.py", check=False)
    assert len(spec.batches) == 4


def test_check_leaves_model_mode(tmp_path: Path) -> None:
    path = write(tmp_path, "model.py", """
        import torch
        from torch import nn

        def get_model():
            return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()

        def get_batches():
            return [torch.randn(3, 4) for _ in range(3)]
    """)
    spec = load_model_py(path)
    assert spec.model.training
    assert int(spec.model[1].num_batches_tracked) == 0  # the check ran in eval mode


def _spec_with(evaluate) -> UserSpec:
    return UserSpec(Path("model.py").resolve(), nn.Linear(4, 2), [torch.randn(2, 4)], [torch.randn(2, 4)], evaluate)


@pytest.mark.parametrize("value", [1, 0.5, torch.tensor(0.25), torch.tensor([2.0])])
def test_run_evaluate_accepts_numbers(value) -> None:
    assert run_evaluate(_spec_with(lambda model, batches: value), nn.Linear(4, 2), []) == float(value)


def test_run_evaluate_nan_is_a_result_not_an_error() -> None:
    assert math.isnan(run_evaluate(_spec_with(lambda model, batches: float("nan")), nn.Linear(4, 2), []))
    assert run_evaluate(_spec_with(lambda model, batches: float("inf")), nn.Linear(4, 2), []) == math.inf


@pytest.mark.parametrize(("value", "words"), [("0.5", "returned a str"), (None, "returned a NoneType"),
                                              (True, "returned a bool"), (torch.ones(3), "returned a Tensor")])
def test_run_evaluate_rejects_non_numbers(value, words: str) -> None:
    with pytest.raises(UserCodeError, match=words):
        run_evaluate(_spec_with(lambda model, batches: value), nn.Linear(4, 2), [])


def test_run_evaluate_wraps_exceptions() -> None:
    def evaluate(model, batches):
        raise ZeroDivisionError("division by zero")

    with pytest.raises(UserCodeError, match=r"evaluate\(\): raised ZeroDivisionError: division by zero") as info:
        run_evaluate(_spec_with(evaluate), nn.Linear(4, 2), [])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_fp32_nan_metric_is_a_user_error(tmp_path: Path) -> None:
    path = write(tmp_path, "model.py", """
        import torch
        from torch import nn

        def get_model():
            return nn.Linear(4, 2)

        def get_batches():
            return [torch.randn(2, 4) for _ in range(2)]

        def evaluate(model, batches):
            return float("nan")
    """)
    with pytest.raises(UserCodeError, match="returned nan for the unchanged fp32 model"):
        load_model_py(path)


class TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return (x + y) * scale


def test_call_model_conventions() -> None:
    x, y = torch.ones(2), torch.full((2,), 2.0)
    assert torch.equal(call_model(nn.Identity(), x), x)
    assert torch.equal(call_model(TwoInputs(), (x, y)), x + y)
    assert torch.equal(call_model(TwoInputs(), [x, y]), x + y)
    assert torch.equal(call_model(TwoInputs(), {"x": x, "y": y, "scale": 2.0}), 2 * (x + y))
    with pytest.raises(TypeError, match="a batch must be"):
        call_model(TwoInputs(), "x")


def test_to_device_keeps_structure() -> None:
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), torch.ones(1)), "scale": 2.0}
    moved = to_device(batch, "cpu")
    assert moved.keys() == batch.keys() and isinstance(moved["pair"], tuple) and moved["scale"] == 2.0
    assert torch.equal(moved["x"], batch["x"])
    assert isinstance(to_device([torch.ones(1)], torch.device("cpu")), list)


# Every batch checked at load time; fidelity's outputs checked before any work.

def test_describe_batch() -> None:
    from autoprec.inputs.userspec import describe_batch

    ids = torch.zeros(16, 128, dtype=torch.long)
    assert describe_batch({"input_ids": ids, "attention_mask": ids}) == "input_ids 16x128, attention_mask 16x128"
    assert describe_batch((torch.ones(2, 3), torch.tensor(1.0), 0.5)) == "[0] 2x3, [1] scalar, [2] float"
    assert describe_batch(torch.ones(4, 5, 6)) == "4x5x6"


MODEL = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            {body}

    def get_model():
        torch.manual_seed(0)
        return Net()

    def get_batches():
        return [torch.randn(2, 4) for _ in range(3)] + [{last}]
"""


def model_py(tmp_path: Path, body: str = "return y", last: str = "torch.randn(2, 4)", extra: str = "") -> Path:
    text = textwrap.dedent(MODEL.format(body=body, last=last)) + textwrap.dedent(extra)
    return write(tmp_path, "model.py", text)


def test_a_later_batch_that_does_not_fit_is_named(tmp_path: Path) -> None:
    with pytest.raises(UserCodeError, match=r"get_batches\(\): batch 3 \(2x5\) does not fit .*mat1 and mat2") as info:
        load_model_py(model_py(tmp_path, last="torch.randn(2, 5)"))
    assert "; fix: return batches shaped as the model's forward expects (called as model(x))" in str(info.value)


def test_a_forward_that_raises_on_a_later_batch_is_named(tmp_path: Path) -> None:
    body = "if x.abs().max() > 50:\n                raise ValueError('input out of range')\n            return y"
    with pytest.raises(UserCodeError, match=r"batch 3 \(2x4\) does not fit .*ValueError: input out of range"):
        load_model_py(model_py(tmp_path, body=body, last="torch.full((2, 4), 99.0)"))


@pytest.mark.parametrize(("body", "words"), [
    ("return y, y.argmax(-1)", r"output\[1\] is an int64 tensor; fidelity .* compares float outputs only"),
    ("return {'y': y, 'label': 'cat'}", r"output\['label'\] is str 'cat'"),
    ("return y > 0", r"output is a bool tensor"),
    ("return {'n': 3}", "holds no float tensor to compare"),
])
def test_fidelity_refuses_outputs_it_cannot_compare(tmp_path: Path, body: str, words: str) -> None:
    with pytest.raises(UserCodeError, match=words) as info:
        load_model_py(model_py(tmp_path, body=body))
    assert "; fix: define evaluate(model, batches)" in str(info.value) and "\n" not in str(info.value)


def test_fidelity_accepts_none_numbers_and_float_tensors(tmp_path: Path) -> None:
    spec = load_model_py(model_py(tmp_path, body="return {'y': y, 'aux': None, 'n': 3, 'ok': True}"))
    assert spec.evaluate is None


def test_fidelity_refuses_an_fp32_output_that_is_already_inf(tmp_path: Path) -> None:
    body = "return y if x.abs().max() < 50 else y * float('inf')"
    with pytest.raises(UserCodeError, match=r"output holds inf/NaN in fp32 on batch 3, so no precision can be judged"):
        load_model_py(model_py(tmp_path, body=body, last="torch.full((2, 4), 99.0)"))


def test_with_evaluate_any_output_is_fine(tmp_path: Path) -> None:
    extra = ("\ndef evaluate(model, batches):\n"
             "    return float(sum((model(b)[1] == 0).float().mean() for b in batches))\n")
    spec = load_model_py(model_py(tmp_path, body="return y, y.argmax(-1)", extra=extra))
    assert spec.evaluate is not None


def test_evaluate_errors_later_in_the_pipeline_name_the_file(tmp_path: Path) -> None:
    extra = """
        calls = []

        def evaluate(model, batches):
            calls.append(1)
            if len(calls) > 1:
                return {}["accuracy"]
            return 1.0
    """
    path = model_py(tmp_path, extra=extra)
    spec = load_model_py(path)  # the load check calls it once
    with pytest.raises(UserCodeError, match=r"evaluate\(\): raised KeyError: 'accuracy' \(line \d+\); fix: ") as info:
        spec.evaluate(spec.model, spec.search_batches)
    assert str(info.value).startswith(f"{path.resolve()}: evaluate(): ")


# ---- the model must be fp32 with data (issue 15) ---------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize("convert, dtype", [(nn.Module.half, "float16"), (nn.Module.bfloat16, "bfloat16"),
                                            (nn.Module.double, "float64")])
def test_check_fp32_model_names_the_dtype_and_the_fix(convert, dtype: str) -> None:
    with pytest.raises(ModelDataError, match=rf"not fp32: its weights are {dtype} \(\d+ of \d+ floating tensors"
                                             r".*return model\.float\(\)"):
        check_fp32_model(convert(_mlp()))


def test_check_fp32_model_looks_at_floating_buffers_and_passes_fp32() -> None:
    model = _mlp()
    check_fp32_model(model)  # fp32, with an int64 buffer (num_batches_tracked): fine
    model.register_buffer("table", torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ModelDataError, match=r"float64 \(1 of \d+ floating tensors, e.g. 'table'\)"):
        check_fp32_model(model)


def test_a_meta_model_is_said_to_have_no_data(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(ModelDataError, match="'meta' device, so they hold no data.*to_empty"):
        check_fp32_model(model)
    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "def get_model():\n    return nn.Linear(4, 2).double()\n"
                    "def get_batches():\n    return [torch.randn(2, 4) for _ in range(3)]\n")
    with pytest.raises(UserCodeError, match=r"model\.py: get_model\(\): the model is not fp32.*float64"):
        load_model_py(path)  # named before the batches are blamed for a dtype mismatch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_as_published_in_half_is_tuned_from_an_exact_upcast(tmp_path: Path, dtype: torch.dtype) -> None:
    """Issue 44: a checkpoint published in bf16 or fp16 is tuned as published: its weights upcast to fp32 (exact),
    which is the reference; the spec says which dtype it came in."""
    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    f"def get_model():\n    torch.manual_seed(0)\n    return nn.Linear(4, 2).to({dtype})\n"
                    "def get_batches():\n    return [torch.randn(2, 4) for _ in range(3)]\n")
    spec = load_model_py(path)
    assert spec.published == dtype
    assert spec.model.weight.dtype == torch.float32
    torch.manual_seed(0)
    assert torch.equal(spec.model.weight, nn.Linear(4, 2).to(dtype).float().weight)  # the published values, exactly


def test_a_model_mixing_half_dtypes_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "def get_model():\n    return nn.Sequential(nn.Linear(4, 4).half(), nn.Linear(4, 2).bfloat16())\n"
                    "def get_batches():\n    return [torch.randn(2, 4) for _ in range(3)]\n")
    with pytest.raises(UserCodeError, match=r"not fp32.*float16.*bfloat16.*model\.float\(\)"):
        load_model_py(path)
    fp32 = tmp_path / "fp32.py"
    fp32.write_text(path.read_text().replace(".half()", "").replace(".bfloat16()", ""))
    assert load_model_py(fp32).published is None  # fp32 as today: nothing said, nothing changed
