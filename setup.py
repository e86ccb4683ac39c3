"""The one thing pyproject.toml cannot say: the top-level ``configs/`` directory is installed as the package
``dsv41_jax.configs``, so the run configs (``dsv41 train --config pretrain_tiny``) ship with the library."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["dsv41_jax", "dsv41_jax.*", "pallas_kernels", "pallas_kernels.*"])
    + ["dsv41_jax.configs"],
    package_dir={"dsv41_jax.configs": "configs"},
    package_data={"dsv41_jax.configs": ["*.yaml"]},
)
