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


# Kernels that read before their wait, and the memory they may read then: what the kernel launched before them does not
# write (radiance.kernels.lora's docstring says why that holds for these two).
READS_BEFORE_WAIT = {"lora_shrink_kernel": {"x_ptr", "scale_ptr", "a_ptr", "slots_ptr"},
                     "lora_expand_add_kernel": {"b_ptr", "slots_ptr"}}
WRITES = ("store", "atomic_", "inline_asm", "gdc_")


def _is_handoff(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and getattr(stmt.value.func, "id", None) == "pdl_handoff")


def _pointers(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}


def _reads_only(stmts: list[ast.stmt], allowed: set[str], where: str) -> None:
    """No write, asm or PDL call in stmts, every load's pointer built from `allowed` pointers alone, and the jit
    helpers they call likewise (their `*_ptr` parameters bound to allowed pointers are theirs to read)."""
    functions = _jit_functions()
    for node in (n for stmt in stmts for n in ast.walk(stmt)):
        if not isinstance(node, ast.Call):
            continue
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        assert not called.startswith(WRITES), f"{where}: {ast.unparse(node)} before the wait"
        if called == "load":
            pointers = _pointers(node.args[0])
            assert pointers and pointers <= allowed, f"{where}: {ast.unparse(node.args[0])} read before the wait"
        elif called in functions:
            params = functions[called].arg_names
            bound = {param for param, arg in zip(params, node.args) if _pointers(arg)}
            assert all(_pointers(arg) <= allowed for arg in node.args), f"{where}: {ast.unparse(node)}"
            _reads_only(_body_without_docstring(functions[called]), {p for p in bound if p.endswith("_ptr")},
                        f"{where} -> {called}")


@pytest.mark.parametrize("name", _kernels_with("PDL"))
def test_pdl_kernels_wait_first(name):
    """Exactly one pdl_handoff(PDL) (or pdl_handoff(PDL, EARLY_RELEASE): the release may come first, the wait still
    precedes every access), the first statement: nothing is read or written before the wait. Only the kernels of
    READS_BEFORE_WAIT put statements before it, and those read their allowed pointers and write nothing."""
    body = _body_without_docstring(_jit_functions()[name])
    handoffs = [i for i, stmt in enumerate(body) if _is_handoff(stmt)]
    assert len(handoffs) == 1, f"{name}: {len(handoffs)} pdl_handoff statements at the top level"
    call = body[handoffs[0]].value
    assert [ast.unparse(a) for a in call.args] in (["PDL"], ["PDL", "EARLY_RELEASE"])
    if name in READS_BEFORE_WAIT:
        _reads_only(body[:handoffs[0]], READS_BEFORE_WAIT[name], name)
    else:
        assert handoffs[0] == 0, f"{name} starts with {ast.unparse(body[0])}"


def test_the_read_check_catches_writes_and_other_reads():
    """_reads_only fails a store, an atomic, and a load of a pointer outside its set (also through a helper)."""
    for src, allowed in (("tl.store(out_ptr + 1, x)", {"out_ptr"}), ("tl.atomic_add(count_ptr, 1)", {"count_ptr"}),
                         ("y = tl.load(out_ptr + rows)", {"b_ptr"}),
                         ("t = _used_b_tile(out_ptr, ns, live_n, cs, slots, stride_b, W, SLOT_WIDTH)", {"b_ptr"})):
        with pytest.raises(AssertionError):
            _reads_only(ast.parse(src).body, allowed, "case")
    _reads_only(ast.parse("t = _used_b_tile(b_ptr, ns, live_n, cs, slots, stride_b, W, 16)").body, {"b_ptr"}, "ok")


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
