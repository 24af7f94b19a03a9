# posenc_torch_from_python(PYTHON): the libtorch inside the torch that the interpreter PYTHON imports
# (a PyPI wheel), as the imported target posenc::libtorch, and its version in POSENC_TORCH_VERSION.
#
# Why not the wheel's own TorchConfig (torch/share/cmake/Torch): PyPI's Linux wheels are CUDA builds,
# and their Caffe2Config enables CUDA as a CMake language, which fails on a machine without nvcc.
# The ops are CPU code: they need the wheel's headers, c10 and torch_cpu, compiled with the C++ ABI
# the wheel was built with (torch._C._GLIBCXX_USE_CXX11_ABI) — what torch.utils.cpp_extension uses.
set(POSENC_TORCH_MINIMUM_VERSION 2.4)  # torch.library.register_fake and opcheck

function(posenc_torch_from_python python)
  if(TARGET posenc::libtorch)
    return()
  endif()
  execute_process(
    COMMAND "${python}" -c "import os, torch; print(torch.__version__.split('+')[0]); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(os.path.dirname(torch.__file__))"
    RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "posenc: POSENC_PYTHON = ${python} cannot import torch; expected an interpreter with "
                        "torch >= ${POSENC_TORCH_MINIMUM_VERSION} (the set-up's: ~/.cache/posenc/venv-torch-*/bin/python)\n${err}")
  endif()
  string(REPLACE "\n" ";" out "${out}")
  list(GET out 0 version)
  list(GET out 1 abi)
  list(GET out 2 dir)
  if(version VERSION_LESS POSENC_TORCH_MINIMUM_VERSION)
    message(FATAL_ERROR "posenc: ${python} has torch ${version}; expected torch >= ${POSENC_TORCH_MINIMUM_VERSION}")
  endif()
  foreach(library c10 torch_cpu)
    if(NOT EXISTS "${dir}/lib/lib${library}.so")
      message(FATAL_ERROR "posenc: torch ${version} at ${dir} has no lib/lib${library}.so; expected a wheel's layout")
    endif()
  endforeach()
  add_library(posenc::libtorch INTERFACE IMPORTED GLOBAL)
  set_target_properties(posenc::libtorch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${dir}/include;${dir}/include/torch/csrc/api/include"
    INTERFACE_LINK_LIBRARIES "${dir}/lib/libtorch_cpu.so;${dir}/lib/libc10.so"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${abi}")
  set(POSENC_TORCH_VERSION "${version}" PARENT_SCOPE)
  set(POSENC_TORCH_LIBRARY_DIR "${dir}/lib" PARENT_SCOPE)
  message(STATUS "posenc: torch ${version} from ${python} (${dir})")
endfunction()
