// One ISA level's extension module, `pacer_cpu_<level>`: compiled once per level (the name
// differs), it only registers bindings.cpp's functions. Each level needs its own module name:
// Python hands back the module already loaded under a name, whichever file it came from.
#include <pybind11/pybind11.h>

void pacer_bind(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { pacer_bind(m); }
