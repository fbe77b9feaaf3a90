"""Package discovery only; metadata lives in pyproject.toml.

The repo root keeps the design card's layout (cli/, engines/, recipes/, hw_profiles/).
Installed, every one of those folders sits under the single `mlxkit` namespace, so no
generic top-level name such as `engines` or `recipes` is claimed in site-packages.
"""

from setuptools import find_packages, setup

FOLDER_TO_PACKAGE = {
    "cli": "mlxkit.cli",
    "engines": "mlxkit.engines",
    "recipes": "mlxkit.recipes",
    "hw_profiles": "mlxkit.hw_profiles",
}

packages = ["mlxkit"]
package_dir = {"mlxkit": "mlxkit"}
for folder, package in FOLDER_TO_PACKAGE.items():
    package_dir[package] = folder
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
