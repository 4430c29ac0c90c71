# Which GPU architectures the CUDA engine is compiled for (included by CMakeLists.txt; tests/test_build.py runs it
# on its own with `cmake -P`). Compile time grows with every architecture, and a 2-core Colab machine builds in
# minutes only for one, so the choice, in order:
#   1. what the user asked: -DCMAKE_CUDA_ARCHITECTURES=... or the CUDAARCHS environment variable (CMake's own names);
#   2. the GPUs visible at build time, exactly (what CMake 3.24's "native" does, asked of nvidia-smi instead so that
#      it also works with CMake 3.18 and can be tested with a stand-in nvidia-smi); a GPU newer than this nvcc knows
#      gets the PTX of the newest architecture nvcc has, which the driver compiles at load time;
#   3. no GPU visible (a CI machine, a wheel build): 75 (T4), 80 (A100, and A10/L4/RTX 30xx/40xx: sm_86/sm_89 run
#      sm_80 code) and 90 (H100/H200) as machine code, plus the PTX of 90, so that newer GPUs still run.
# Sets `out_var` to the list and `how_var` to a few words on why, for the configure message.

set(FASTGPT_DEFAULT_CUDA_ARCHITECTURES "75-real;80-real;90")

# The function's answer (a macro, so that PARENT_SCOPE is the function's caller).
macro(_fastgpt_answer archs how)
  set(${out_var} "${archs}" PARENT_SCOPE)
  set(${how_var} "${how}" PARENT_SCOPE)
endmacro()

function(fastgpt_cuda_architectures out_var how_var)
  if(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "")
    _fastgpt_answer("${CMAKE_CUDA_ARCHITECTURES}" "CMAKE_CUDA_ARCHITECTURES")
    return()
  endif()
  if(DEFINED ENV{CUDAARCHS} AND NOT "$ENV{CUDAARCHS}" STREQUAL "")
    _fastgpt_answer("$ENV{CUDAARCHS}" "CUDAARCHS")
    return()
  endif()

  find_program(_fastgpt_smi nvidia-smi NO_CACHE)
  set(_visible "")
  if(_fastgpt_smi)
    execute_process(COMMAND "${_fastgpt_smi}" --query-gpu=compute_cap --format=csv,noheader
                    RESULT_VARIABLE _rc OUTPUT_VARIABLE _caps ERROR_QUIET TIMEOUT 30)
    if(_rc EQUAL 0)
      string(REPLACE "\n" ";" _caps "${_caps}")
      foreach(_cap IN LISTS _caps)
        string(STRIP "${_cap}" _cap)
        if(_cap MATCHES "^([0-9]+)\\.([0-9]+)$")  # "8.6" -> 86; anything else (an old driver's error) is no GPU
          list(APPEND _visible "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
        endif()
      endforeach()
      list(REMOVE_DUPLICATES _visible)
    endif()
  endif()
  if(NOT _visible)
    _fastgpt_answer("${FASTGPT_DEFAULT_CUDA_ARCHITECTURES}" "no GPU visible: the default list")
    return()
  endif()

  # What this nvcc can compile for ("compute_75" ... per line); unknown (no nvcc given) means: trust the GPU.
  set(_known "")
  if(FASTGPT_NVCC)
    execute_process(COMMAND "${FASTGPT_NVCC}" --list-gpu-arch RESULT_VARIABLE _rc OUTPUT_VARIABLE _list ERROR_QUIET
                    TIMEOUT 30)
    if(_rc EQUAL 0)
      string(REGEX MATCHALL "compute_[0-9]+" _list "${_list}")
      foreach(_arch IN LISTS _list)
        string(REPLACE "compute_" "" _arch "${_arch}")
        list(APPEND _known "${_arch}")
      endforeach()
    endif()
  endif()
  set(_archs "")
  foreach(_arch IN LISTS _visible)
    list(FIND _known "${_arch}" _at)  # (not IN_LIST: `cmake -P` runs without policy CMP0057)
    if(NOT _known OR _at GREATER -1)
      list(APPEND _archs "${_arch}")
    else()
      set(_newest 0)
      foreach(_k IN LISTS _known)
        if(_k GREATER _newest)
          set(_newest ${_k})
        endif()
      endforeach()
      message(STATUS "fastgpt: this nvcc cannot compile for the visible sm_${_arch}; using compute_${_newest} PTX")
      list(APPEND _archs "${_newest}-virtual")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _archs)
  _fastgpt_answer("${_archs}" "the GPUs visible at build time")
endfunction()
