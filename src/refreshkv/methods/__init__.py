"""Every KV method, one file each, plus methods that other packages register.

`load_methods()` (run by `import refreshkv`) imports every module of this package, which registers its methods, and
then loads the entry points of the group `refreshkv.methods`: a third-party package adds a method without forking by
declaring, in its pyproject.toml,

    [project.entry-points."refreshkv.methods"]
    my_method = "my_package.my_module:MyPolicy"

where `MyPolicy` is a `Policy` subclass (registered here) or a module whose import registers its methods. A plugin
cannot take a registered name unless its class sets `replaces = True` (then one line on stderr says so when it is
loaded, and `refreshkv methods`, every table that lists methods and every result row name the package that provides
it), and `full` can never be replaced. A plugin that fails to load or collides is
left out with one warning naming its package; the package goes on without it.
"""

import importlib
import inspect
import logging
import pkgutil
from importlib.metadata import entry_points

from ..core.policy import METHODS, Policy, PolicyError, register

ENTRY_POINT_GROUP = "refreshkv.methods"
LOG = logging.getLogger("refreshkv")


def load_methods() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        package = entry.dist.name if entry.dist is not None else entry.value.split(":")[0].split(".")[0]
        try:
            loaded = entry.load()
            if inspect.isclass(loaded) and issubclass(loaded, Policy):
                replaced = METHODS.get(getattr(loaded, "name", ""))
                register(loaded, provider=package)
                if replaced not in (None, loaded):  # said once, when loaded; tables add "(from PACKAGE)"
                    LOG.warning(
                        f"warning: refreshkv: method '{loaded.name}' is {loaded.__module__}.{loaded.__qualname__} "
                        f"from package {package}, replacing {replaced.__module__}.{replaced.__qualname__}"
                    )
        except Exception as error:  # a broken plugin must not break the package: say so and go on without it
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            verb = "was not registered" if isinstance(error, PolicyError) else "failed to load"
            # one line on stderr (logging's last-resort handler, or the application's own logging configuration)
            LOG.warning(f"warning: refreshkv: method plugin '{entry.name}' of package {package} {verb}: {reason}")
