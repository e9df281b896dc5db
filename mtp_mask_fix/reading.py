"""The reading of gpt_step.py's text, never run: whether it shows the batch's loss_mask reaching every model call."""

import ast
import builtins
from dataclasses import dataclass


MASK = "loss_mask"
# An MTP call: one whose model's config (`config`, as every release names it) has MTP layers, as releases test it.
MTP_ON = ast.dump(ast.parse('(getattr(config, "mtp_num_layers", None) or 0) > 0', mode="eval").body)


@dataclass(frozen=True)
class Reading:
    """Whether the text shows the fix (True), shows it missing (False) or neither (None: the probe decides); why."""

    fixed: bool | None
    why: str = ""  # `FILE:LINE `text`` and what is amiss there; "" where fixed


def read(text: str, path: str = "gpt_step.py") -> Reading:
    """What the text shows of the loss_mask each `model(**kwargs)` call receives; the least fixed call decides."""
    try:
        module = ast.parse(text)
    except SyntaxError as exc:
        return Reading(False, f"{path}:{exc.lineno} does not parse")
    owner = _owners(module)
    calls = [node for node in owner if getattr(getattr(node, "func", None), "id", "") == "model"]  # model(**kwargs)
    found = [_given(module, owner[call], call) for call in calls if any(kw.arg is None for kw in call.keywords)]
    found = found or [(False, "has no `model(**...)` call", None)]
    fixed, said, node = min(found, key=lambda one: [False, None, True].index(one[0]))
    return Reading(True) if fixed else Reading(fixed, f"{_at(text, path, node) if node else path} {said}")


def unbound(text: str, lines: set[int], path: str = "gpt_step.py") -> str:
    """Where a statement on `lines` reads a name nothing binds (it raises NameError once run), "" if none."""
    module = ast.parse(text)
    owner = _owners(module)
    for stmt in (node for node in ast.walk(module) if isinstance(node, ast.stmt) and node.lineno in lines):
        if stmt in owner and (free := _free(module, owner[stmt], getattr(stmt, "test", stmt))):
            return f"{_at(text, path, stmt)} names {free}"
    return ""


def _owners(module: ast.Module) -> dict[ast.AST, ast.FunctionDef]:
    """The function each node is in, the innermost (walked last)."""
    return {node: f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) for node in ast.walk(f)}


def _at(text: str, path: str, node: ast.AST) -> str:
    return f"{path}:{node.lineno} `{text.splitlines()[node.lineno - 1].strip()}`"


def _given(module: ast.Module, func: ast.FunctionDef, call: ast.Call) -> tuple[bool | None, str, ast.AST]:
    """Whether `call` hands the model the batch's loss_mask on every MTP call, what is amiss if not, and where."""
    # Followed: the dict the call unpacks, made by a literal, and item sets of constant keys; any other use of it or
    # of its loss_mask before the call (del, pop, a read, a key in a variable, the dict passed on) is the probe's.
    parents = {kid: node for node in ast.walk(func) for kid in ast.iter_child_nodes(node)}
    unpacked = [kw.value for kw in call.keywords if kw.arg is None]
    name = getattr(unpacked[0], "id", None)
    params = [a.arg for a in ast.walk(func.args) if isinstance(a, ast.arg)]
    unsure = [*unpacked[1:], *([call] if name is None or name in params else [])]  # not a dict made here: the probe's
    word = None  # the last statement on the mask
    uses = [node for node in ast.walk(func) if isinstance(node, ast.Name) and node.id == name]
    for node in sorted(uses, key=lambda node: (node.lineno, node.col_offset)):
        up, top = parents[node], parents.get(parents[node])
        key = getattr(up.slice, "value", None) if isinstance(up, ast.Subscript) else None
        if node.lineno > call.lineno or isinstance(up, ast.Compare) or isinstance(up, ast.keyword) and top is call:
            continue  # after the call, a test, the call's own unpacking
        if isinstance(key, str) and key != MASK:
            continue  # another key
        if key == MASK and isinstance(top, ast.Assign) and top.targets == [up]:
            word = (top, top.value)
        elif isinstance(up, ast.Assign) and up.targets == [node] and isinstance(up.value, ast.Dict):
            keys = [getattr(key, "value", None) for key in up.value.keys]  # None: `**other`, a key in a variable
            unsure += [value for key, value in zip(keys, up.value.values) if not isinstance(key, str)]
            word = next(((up, v) for k, v in reversed(list(zip(keys, up.value.values))) if k == MASK), None)
        else:
            unsure.append(node)
    word = next(((call, kw.value) for kw in call.keywords if kw.arg == MASK), word)
    if unsure:
        return None, "does what check cannot follow", unsure[-1]
    if word is None:
        return False, "gets no loss_mask", call
    stmt, value = word
    if getattr(value, "id", "") != MASK:
        return None, "may hand the model something other than the batch's loss_mask", value
    if free := _free(module, func, value):
        return None, f"names {free}", stmt
    if stmt is not call and (guard := _skips(stmt, call, parents, func)):
        return None, "may skip the line that hands the model its loss_mask", guard
    return True, "", call


def _skips(stmt: ast.stmt, call: ast.Call, parents: dict, func: ast.FunctionDef) -> ast.AST | None:
    """The statement around `stmt` that may skip it on an MTP call that reaches `call`; None if it runs on each."""
    # It runs where it is in a block that holds the call further on, or in the body of an `if` that tests MTP there.
    path = [call]
    while path[-1] in parents:
        path.append(parents[path[-1]])
    node = stmt
    while (up := parents[node]) not in path:
        test = getattr(up, "test", None)  # an `if` holds on every MTP call that tests MTP_ON, or a name bound to it
        if isinstance(test, ast.Name):  # each name bound once, by a statement of the function's own before the `if`
            put = [n for n in ast.walk(func) if getattr(n, "id", "") == test.id and isinstance(n.ctx, ast.Store)]
            test = next((s.value for s in func.body if getattr(s, "targets", 0) == put and s.lineno < up.lineno), test)
        if not (isinstance(up, ast.If) and node in up.body and ast.dump(test) == MTP_ON):
            return up
        node = up
    below = path[path.index(up) - 1]  # what holds the call in `up`: in the same block as `node`, after it
    return None if any(isinstance(v, list) and node in v and below in v for _, v in ast.iter_fields(up)) else up


def _free(module: ast.Module, func: ast.FunctionDef, node: ast.AST) -> str:
    """`NAME, which FUNCTION does not bind` for the first name `node` reads that nothing binds, "" if none."""
    top = [n for stmt in module.body if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(stmt)]
    names = {n.name for n in module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | set(dir(builtins))
    names |= {arg.arg for arg in ast.walk(func.args) if isinstance(arg, ast.arg)}
    for n in [*ast.walk(func), *top, *ast.walk(node)]:  # what the function, the module or `node` itself binds
        names |= {n.id} if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) else set()
        names |= {(a.asname or a.name).split(".")[0] for a in getattr(n, "names", []) if isinstance(a, ast.alias)}
    free = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in names]
    return f"`{free[0]}`, which `{func.name}` does not bind" if free else ""
