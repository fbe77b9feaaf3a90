"""Package discovery only; metadata lives in pyproject.toml.

The repo root keeps cli/, engines/, recipes/ and hw_profiles/ as top-level folders, so
paths stay short for readers. Installed, every one of those folders sits under the
single `mlxkit` namespace, so no generic top-level name such as `engines` or `recipes`
is claimed in site-packages.
"""

from setuptools import find_namespace_packages, find_packages, setup

CODE_FOLDERS = {"cli": "mlxkit.cli", "engines": "mlxkit.engines"}
# Folders of YAML files: every subfolder is listed as a package, with or without an
# __init__.py, so its files ship as package data (and setuptools does not warn that an
# importable folder is missing from `packages`).
DATA_FOLDERS = {"recipes": "mlxkit.recipes", "hw_profiles": "mlxkit.hw_profiles"}

packages = ["mlxkit"]
package_dir = {"mlxkit": "mlxkit"}
for folder, package in {**CODE_FOLDERS, **DATA_FOLDERS}.items():
    package_dir[package] = folder
    packages.append(package)
    if folder in DATA_FOLDERS:
        subpackages = find_namespace_packages(folder, exclude=["*__pycache__*"])
    else:
        subpackages = find_packages(folder)
    packages += [f"{package}.{sub}" for sub in subpackages]

setup(packages=packages, package_dir=package_dir)
