"""Static checks of the programmatic-dependent-launch protocol (DESIGN: a kernel launched with
`launch_pdl` may start while the kernel before it still runs, so it must wait before it touches
memory). No GPU needed: the kernels' and launchers' source is read with `ast`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import triton

import radiance

ROOT = Path(radiance.__file__).parent
SOURCES = sorted(p for p in ROOT.rglob("*.py") if "launch_pdl" in p.read_text() or "PDL" in p.read_text())


def _jit_functions() -> dict[str, triton.runtime.JITFunction]:
    from radiance.kernels import lora
    from radiance.kernels._triton import (act_quant, argmax, convert, gemm, moe_combine, moe_gemm, moe_route,
                                          moe_router, rotary)
    from radiance.layers import attention_merge, attention_triton

    found = {}
    for module in (act_quant, argmax, convert, gemm, moe_combine, moe_gemm, moe_route, moe_router, rotary,
                   attention_triton, attention_merge, lora):
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction):
                found[name] = obj
    return found


def _body_without_docstring(fn: triton.runtime.JITFunction) -> list[ast.stmt]:
    tree = ast.parse(inspect.cleandoc("\n" + fn.src) if fn.src.startswith(" ") else fn.src)
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _kernels_with(param: str) -> list[str]:
    """Launched kernels (not jit helpers such as pdl_handoff itself) that take `param`."""
    return sorted(name for name, fn in _jit_functions().items() if name.endswith("_kernel") and param in fn.arg_names)


def test_some_kernels_take_part():
    assert len(_kernels_with("PDL")) >= 8 and _kernels_with("PDL_PREFETCH") == ["w4a8_gemm_kernel"]


@pytest.mark.parametrize("name", _kernels_with("PDL"))
def test_pdl_kernels_wait_first(name):
    """Their first statement is pdl_handoff(PDL) (or pdl_handoff(PDL, EARLY_RELEASE): the release may come first,
    the wait still precedes every access): nothing is read or written before the wait."""
    first = _body_without_docstring(_jit_functions()[name])[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), ast.dump(first)
    call = first.value
    assert getattr(call.func, "id", None) == "pdl_handoff", f"{name} starts with {ast.unparse(first)}"
    assert [ast.unparse(a) for a in call.args] in (["PDL"], ["PDL", "EARLY_RELEASE"])


def _launches() -> list[tuple[Path, str, ast.Call]]:
    """Every `kernel[grid](..., launch_pdl=...)` or `kernel.run(..., launch_pdl=...)` call in the package: (file,
    kernel name, call)."""
    out = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and any(k.arg == "launch_pdl" for k in node.keywords):
                # kernel[grid](...), or kernel.run(..., grid=..., warmup=...) (the launch w4a8 also looks up)
                run = isinstance(node.func, ast.Attribute) and node.func.attr == "run"
                target = node.func.value if isinstance(node.func, ast.Subscript) or run else node.func
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "?")
                out.append((path, name, node))
    return out


def test_every_pdl_launch_names_a_waiting_kernel():
    """launch_pdl only on kernels that wait, and launched with the same switch on (PDL; the GEMM's
    DEPENDENT): a launch_pdl without the kernel's wait would let it read its input before it is written."""
    kernels = _jit_functions()
    launches = _launches()
    assert len(launches) >= 8
    for path, name, call in launches:
        where = f"{path.relative_to(ROOT)}: {name}"
        assert name in kernels, f"{where}: launch_pdl on an unknown kernel"
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        switches = set(keywords) & {"PDL", "DEPENDENT"}
        assert len(switches) == 1 and switches <= set(kernels[name].arg_names), f"{where}: launch_pdl without its PDL switch"
        assert keywords["launch_pdl"] == keywords[switches.pop()], f"{where}: launch_pdl and the kernel's switch differ"
