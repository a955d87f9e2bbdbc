"""Not the fedskew package: the root folder of a fedskew source checkout.

Python imports this folder as ``fedskew`` only when a script runs from the folder that holds a
clone named ``fedskew/``: the clone then shadows the installed package (an editable install's
finder comes after the script's own folder), and ``fedskew.run`` would not exist. This file loads
the package inside the clone instead and says so in one line on stderr.
"""

import importlib.util
import sys
from pathlib import Path

if __name__ == "fedskew":
    _inner = Path(__file__).resolve().parent / "fedskew" / "__init__.py"
    _spec = importlib.util.spec_from_file_location(__name__, _inner, submodule_search_locations=[str(_inner.parent)])
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
    print(f"fedskew: '{Path(__file__).parent}' is a fedskew source checkout beside your script, so Python imported "
          f"that folder instead of the package; the package inside it ({_inner.parent}) is used. Run from another "
          f"folder, or rename the clone, to import the installed one.", file=sys.stderr)
