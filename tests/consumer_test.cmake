# Installs the build tree, then builds and runs, against the installed copy only:
#   1. tests/consumer/consumer.cpp and every ```cpp block of README.md, through find_package(posenc);
#   2. consumer.cpp again through pkg-config and the compiler alone.
# cmake -DBUILD_DIR=… -DSOURCE_DIR=… -DWORK_DIR=… -DCXX=… -P consumer_test.cmake
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
