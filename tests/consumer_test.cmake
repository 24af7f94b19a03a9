# Installs the build tree, then builds and runs, against the installed copy only:
#   1. tests/consumer/consumer.cpp and every ```cpp block of README.md, through find_package(posenc);
#   2. consumer.cpp again through pkg-config and the compiler alone;
#   3. with the PyTorch extension built: torch_consumer.cpp through find_package(posenc COMPONENTS
#      torch), and the installed Python package from another directory;
#   4. the Debian package (cpack -G DEB), unpacked into a scratch root: its contents, its
#      dependencies, and consumer.cpp built against it.
# cmake -DBUILD_DIR=… -DSOURCE_DIR=… -DWORK_DIR=… -DCXX=… -DWITH_TORCH=ON|OFF [-DPYTHON=…] -P consumer_test.cmake
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT status EQUAL 0)
    string(REPLACE ";" " " shown "${ARGN}")
    message(FATAL_ERROR "failed (${status}): ${shown}\n${out}\n${err}")
  endif()
  message("${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/install)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# The README's C++ examples, one program each.
set(programs ${WORK_DIR}/programs)
file(MAKE_DIRECTORY ${programs})
file(COPY ${SOURCE_DIR}/tests/consumer/consumer.cpp DESTINATION ${programs})
file(READ ${SOURCE_DIR}/README.md readme)
# CMake lists split on ';': hide the code's semicolons (and brackets, which suppress splitting)
# while the blocks travel as a list, and restore them when writing each file.
string(REPLACE ";" "@SEMICOLON@" readme "${readme}")
string(REPLACE "[" "@OPEN@" readme "${readme}")
string(REPLACE "]" "@CLOSE@" readme "${readme}")
string(REGEX MATCHALL "```cpp\n[^`]*```" blocks "${readme}")
list(LENGTH blocks count)
if(count EQUAL 0)
  message(FATAL_ERROR "README.md has no ```cpp example to test")
endif()
set(index 0)
foreach(block IN LISTS blocks)
  string(REGEX REPLACE "^```cpp\n" "" code "${block}")
  string(REGEX REPLACE "```$" "" code "${code}")
  string(REPLACE "@SEMICOLON@" ";" code "${code}")
  string(REPLACE "@OPEN@" "[" code "${code}")
  string(REPLACE "@CLOSE@" "]" code "${code}")
  math(EXPR index "${index} + 1")
  file(WRITE ${programs}/readme_example_${index}.cpp "${code}")
endforeach()

run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G Ninja
    -DCMAKE_PREFIX_PATH=${prefix} -DPROGRAM_DIR=${programs} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
foreach(i RANGE 1 ${index})
  run(${WORK_DIR}/build/readme_example_${i})
endforeach()

# pkg-config, as a Makefile user would.
set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig:${prefix}/lib/x86_64-linux-gnu/pkgconfig)
execute_process(COMMAND pkg-config --cflags --libs posenc OUTPUT_VARIABLE flags RESULT_VARIABLE status
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "pkg-config does not know posenc")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
run(${CXX} ${programs}/consumer.cpp ${flags} -Wl,-rpath,${prefix}/lib -o ${WORK_DIR}/consumer_pkgconfig)
run(${WORK_DIR}/consumer_pkgconfig)

# The PyTorch extension: posenc::torch for libtorch programs, and the Python package.
if(WITH_TORCH)
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build_torch -G Ninja -DWITH_TORCH=ON
      -DCMAKE_PREFIX_PATH=${prefix} -DPROGRAM_DIR=${WORK_DIR}/none -DCMAKE_BUILD_TYPE=Release)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/build_torch)
  run(${WORK_DIR}/build_torch/torch_consumer)
  # From the work directory, so that nothing but PYTHONPATH can supply the package.
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PYTHONPATH=${prefix}/lib/python3/dist-packages ${PYTHON} -c
                  "import posenc, torch; assert posenc.__file__.startswith('${prefix}'), posenc.__file__; print('python ok', posenc.alibi_slopes(4).tolist())"
                  WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT status EQUAL 0 OR NOT out MATCHES "python ok \\[0.25, 0.0625, 0.015625, 0.00390625\\]")
    message(FATAL_ERROR "the installed Python package failed (${status}):\n${out}\n${err}")
  endif()
  message("${out}")
endif()

# The Debian package, unpacked (dpkg-deb -x) into a scratch root instead of installed.
run(${CMAKE_CPACK_COMMAND} --config ${BUILD_DIR}/CPackConfig.cmake -G DEB -B ${WORK_DIR}/deb)
file(GLOB debs ${WORK_DIR}/deb/posenc_*.deb)
list(LENGTH debs count)
if(NOT count EQUAL 1)
  message(FATAL_ERROR "cpack made ${count} packages named posenc_*.deb: ${debs}")
endif()
execute_process(COMMAND dpkg-deb -f ${debs} Depends OUTPUT_VARIABLE depends RESULT_VARIABLE status)
if(NOT status EQUAL 0 OR NOT depends MATCHES "libhwy-dev" OR NOT depends MATCHES "libgomp1" OR depends MATCHES "torch")
  message(FATAL_ERROR "the package's Depends: ${depends}; expected libhwy-dev and libgomp1, and no torch")
endif()
set(root ${WORK_DIR}/root)
run(dpkg-deb -x ${debs} ${root})
foreach(file usr/bin/posenc usr/include/posenc/posenc.hpp usr/lib/cmake/posenc/posencConfig.cmake usr/lib/pkgconfig/posenc.pc)
  if(NOT EXISTS ${root}/${file})
    message(FATAL_ERROR "the package has no ${file}")
  endif()
endforeach()
if(EXISTS ${root}/usr/lib/python3)
  message(FATAL_ERROR "the package carries the Python component, which needs libtorch")
endif()
set(deb_programs ${WORK_DIR}/deb_programs)
file(MAKE_DIRECTORY ${deb_programs})
file(COPY ${SOURCE_DIR}/tests/consumer/consumer.cpp DESTINATION ${deb_programs})
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build_deb -G Ninja
    -DCMAKE_PREFIX_PATH=${root}/usr -DPROGRAM_DIR=${deb_programs} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build_deb)
run(${WORK_DIR}/build_deb/consumer)
run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${root}/usr/lib ${root}/usr/bin/posenc alibi-slopes --heads 4)
