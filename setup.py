"""hf_radix: SGLang-style radix prefix caching for Hugging Face transformers."""

from pathlib import Path

from setuptools import find_packages, setup


def _read_requirements(name: str) -> list[str]:
    lines = (Path(__file__).parent / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="hf-radix",
    version="0.1.0",
    description="Radix prefix cache, paged KV pool and continuous batching for Hugging Face transformers",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_radix", "hf_radix.*"]),
    package_data={"hf_radix.kernels": ["*.cu"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=5.17,<6", "numpy", "tqdm", "safetensors"],
    extras_require={
        "triton": ["triton>=3.0"],
        # hybrid models' Gated DeltaNet layers: transformers picks these Triton kernels over its torch paths
        "hybrid": ["flash-linear-attention>=0.6"],
        "datasets": ["datasets"],
        "eval": ["lm-eval>=0.4.13", "accelerate"],
        "test": _read_requirements("requirements-test.txt"),
    },
    entry_points={
        "lm_eval.models": ["hf-radix = hf_radix.lm_eval_backend:HFRadixLM"],
        "console_scripts": ["hf-radix-lm-eval = hf_radix.lm_eval_backend:main"],
    },
)
