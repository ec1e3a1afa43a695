"""The house rules of the package, checked on the source (docs/DESIGN.md, "Module map and
layout"): no import circle between modules, no module importing another's private names, no
package file over 400 lines, kernels/ never importing learner/ (both share learner_math.py, which
imports nothing of the package), no hasattr/getattr probes on the data path, every registered
task and engine described, no comment pointing at issue numbers or at notes outside the
repository, and a real help sentence for every flag of programs/sao.py."""
import ast
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "sao_actor_learner")
MAX_PACKAGE_FILE_LINES = 400
# The modules a rollout and a weight version pass through (actor, learner loop, replay, the
# variable clients): they take the types of core.py, so they never probe what they were given.
DATA_PATH_MODULES = (
    "actors/actor.py", "actors/engine_weights.py", "actors/outbox.py", "actors/evaluator.py",
    "actors/version_recorder.py", "actors/rollout.py", "learner/learner.py",
    "learner/progress.py", "learner/group_keys.py", "learner/checkpointing.py",
    "learner/journal.py", "learner/sampling.py", "replay/reader.py", "replay/writer.py",
    "replay/streams.py", "variables/client.py", "variables/weight_fetch.py",
    "variables/publisher.py", "variables/shm_reader.py")


def package_modules():
    """module name -> path, for every .py of the package (generated stubs left out)."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        if "protos_gen" in folder or "__pycache__" in folder:
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    return modules


def imported(module, path, modules):
    """(module, names) pairs `module` imports at its top level (from package modules only)."""
    pairs = []
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else ".".join(
                module.split(".")[:-node.level] + [node.module])
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in modules:
                    pairs.append((child, None))
                elif base in modules:
                    pairs.append((base, alias.name))
        elif isinstance(node, ast.Import):
            pairs += [(a.name, None) for a in node.names if a.name in modules]
    return pairs


def cycles(graph):
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_circle_and_no_private_imports():
    modules = package_modules()
    graph, private = {}, []
    for module, path in modules.items():
        pairs = imported(module, path, modules)
        # A package's __init__ re-exporting its own children is not a circle.
        graph[module] = {m for m, _ in pairs if m != module and not m.startswith(module + ".")}
        private += [f"{module} imports {m}.{name}" for m, name in pairs
                    if name and name.startswith("_")]
    assert cycles(graph) == []
    assert private == []


def test_files_stay_small_and_comments_point_inside_the_repo():
    too_long, notes = [], []
    outside = re.compile(r"\b(SAO|STYLE|PEERS|ARCHITECTURE)\.md\b|shared/docs|\bissue \d+",
                         re.IGNORECASE)
    roots = [PACKAGE, os.path.join(REPO, "programs"), os.path.join(REPO, "experiments")]
    for root in roots:
        for folder, _, files in os.walk(root):
            if "protos_gen" in folder or "__pycache__" in folder:
                continue
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                lines = open(path).read().splitlines()
                if root == PACKAGE and len(lines) > MAX_PACKAGE_FILE_LINES:
                    too_long.append(f"{path}: {len(lines)} lines")
                notes += [f"{path}:{i + 1}: {line.strip()}" for i, line in enumerate(lines)
                          if outside.search(line)]
    assert too_long == []
    assert notes == []


def test_every_flag_of_the_main_program_has_a_sentence_of_help():
    out = subprocess.run([sys.executable, os.path.join(REPO, "programs", "sao.py"),
                          "--helpfull"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    # The program's own flags and the config's (defined by sao_actor_learner/flags.py).
    sections = [block for block in re.split(r"\n(?=\S)", out)
                if block.startswith(("programs/sao.py:", "sao_actor_learner.__main__:",
                                     "sao_actor_learner.flags:"))]
    flags = re.findall(r"^  --(?:\[no\])?(\w+): (.*)$", "\n".join(sections), re.MULTILINE)
    assert len(flags) > 50, out[:2000]
    vague = [name for name, help_ in flags if len(help_.split()) < 3 or "SAOConfig." in help_]
    assert vague == []


def test_kernels_and_learner_meet_only_in_the_shared_math_module():
    """kernels/ imports nothing of learner/ (learner/ calls the kernels; both take the slow
    references from learner_math.py), and learner_math.py imports nothing of the package."""
    modules = package_modules()
    wrong = []
    for module, path in modules.items():
        targets = {m for m, _ in imported(module, path, modules)}
        if module.startswith("sao_actor_learner.kernels"):
            wrong += [f"{module} imports {m}" for m in targets
                      if m.startswith("sao_actor_learner.learner.") or
                      m == "sao_actor_learner.learner"]
        if module == "sao_actor_learner.learner_math":
            wrong += [f"{module} imports {m}" for m in targets]
    assert "sao_actor_learner.learner_math" in modules
    assert wrong == []


def test_no_attribute_probes_on_the_data_path():
    """hasattr/getattr on the data path would be a contract missing from core.py."""
    probes = []
    for relative in DATA_PATH_MODULES:
        path = os.path.join(PACKAGE, relative)
        assert os.path.exists(path), f"{relative}: listed in DATA_PATH_MODULES but missing"
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("hasattr", "getattr"):
                probes.append(f"{relative}:{node.lineno}: {node.func.id}")
    assert probes == []


def test_every_registered_task_and_engine_is_described():
    from sao_actor_learner.engines.registry import engine_names, engine_spec
    from sao_actor_learner.tasks.registry import task_names, task_spec
    undescribed = [f"task {n}" for n in task_names()
                   if len(task_spec(n).description.split()) < 8]
    undescribed += [f"engine {n}" for n in engine_names()
                    if len(engine_spec(n).description.split()) < 8]
    design = open(os.path.join(REPO, "docs", "DESIGN.md")).read()
    undescribed += [f"{n} not in docs/DESIGN.md" for n in (*task_names(), *engine_names())
                    if not re.search(rf"\b{n}\b", design)]
    assert task_names() and engine_names() and undescribed == []
