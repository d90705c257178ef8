"""What pyproject.toml cannot say: the packages, with the repository's top-level ``configs/`` installed as
``sn_detection/configs``. The yaml configs and LazyConfigs stay where a reader of the repository looks for
them and a wheel still serves them (``package_dir`` maps the one folder onto the other; pyproject.toml's
package-data names the files). A checkout reads ``configs/`` in place (``sn_detection.model_zoo``)."""

from setuptools import find_packages, setup

setup(
    # configs/ has no __init__.py: a folder of data, its LazyConfigs' .py files included, not modules
    packages=find_packages(include=["sn_detection*"]) + ["sn_detection.configs"],
    package_dir={"sn_detection.configs": "configs"},
)
