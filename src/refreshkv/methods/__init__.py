"""Every KV method, one file each, plus methods that other packages register.

`load_methods()` (run by `import refreshkv`) imports every module of this package, which registers its methods, and
then loads the entry points of the group `refreshkv.methods`: a third-party package adds a method without forking by
declaring, in its pyproject.toml,

    [project.entry-points."refreshkv.methods"]
    my_method = "my_package.my_module:MyPolicy"

where `MyPolicy` is a `Policy` subclass (registered here if its module did not already apply `@register`) or a module
whose import registers its methods.
"""

import importlib
import inspect
import pkgutil
import warnings
from importlib.metadata import entry_points

from ..core.policy import Policy, register

ENTRY_POINT_GROUP = "refreshkv.methods"


def load_methods() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
        except Exception as error:  # a broken plugin must not break the package: say so and go on without it
            warnings.warn(
                f"refreshkv: method plugin '{entry.name}' ({entry.value}) failed to load: {error}", stacklevel=2
            )
            continue
        if inspect.isclass(loaded) and issubclass(loaded, Policy):
            register(loaded)
