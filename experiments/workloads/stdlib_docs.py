"""Docstrings of a fixed, sorted list of standard-library modules: part of the tiny BPE
tokenizer's training text (tiny_bpe.py).

Run as a script (`python -I -S stdlib_docs.py`) it prints them as one JSON list. tiny_bpe runs
it that way, in a fresh isolated interpreter without site-packages, because libraries loaded in
the calling process replace standard-library functions (measured: after importing pytest,
torch, transformers and reverb, `inspect` and `collections` yield other docstrings), which
would make the tokenizer depend on what the caller imported. Standard library only.
"""
import importlib
import inspect
import json
import warnings
from typing import Iterator

DOC_MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "http",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "mimetypes", "os",
    "pathlib", "pickle", "platform", "pprint", "queue", "random", "re", "shlex", "shutil",
    "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "tokenize", "trace", "typing", "unittest",
    "urllib", "uuid", "warnings", "wave", "weakref", "zipfile",
)


def docstrings() -> Iterator[str]:
    """Docstrings of DOC_MODULES, their public classes and functions and the classes' public
    methods, in sorted order."""
    for name in sorted(DOC_MODULES):
        module = importlib.import_module(name)
        doc = inspect.getdoc(module)
        if doc:
            yield doc
        for attr, member in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(member, "__module__", None) not in (name,
                                                                                   "_" + name):
                continue
            if inspect.isclass(member) or inspect.isfunction(member) or inspect.isbuiltin(member):
                with warnings.catch_warnings():   # typing.io and typing.re warn on access
                    warnings.simplefilter("ignore", DeprecationWarning)
                    doc = inspect.getdoc(member)
                if doc:
                    yield doc
                if inspect.isclass(member):
                    for method_name, method in sorted(vars(member).items()):
                        if not method_name.startswith("_") and inspect.isfunction(method):
                            doc = inspect.getdoc(method)
                            if doc:
                                yield doc



if __name__ == "__main__":
    print(json.dumps(list(docstrings())))
