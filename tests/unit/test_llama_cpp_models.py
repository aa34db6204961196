"""The F32 copy llama-server loads for `<model>@f32`: every tensor dequantized, metadata kept, file type ALL_F32."""

import gguf
import numpy as np

from serve.engines.llama_cpp.models import dequantize_to_f32, gguf_path


def test_f32_copy_dequantizes_and_keeps_metadata(tmp_path):
    source, target = tmp_path / "m.gguf", tmp_path / "m.f32.gguf"
    weights = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    writer = gguf.GGUFWriter(str(source), arch="llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(128)
    writer.add_tensor("w", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    dequantize_to_f32(source, target)
    reader = gguf.GGUFReader(str(target))
    (tensor,) = reader.tensors
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.allclose(np.asarray(tensor.data).reshape(4, 64), weights, atol=0.01)  # Q8_0 rounding only
    file_type, context_length = reader.get_field("general.file_type"), reader.get_field("llama.context_length")
    assert file_type is not None and file_type.contents() == 0
    assert context_length is not None and context_length.contents() == 128
    assert not list(tmp_path.glob("*.partial"))


def test_f32_suffix_names_a_copy_beside_the_source(tmp_path):
    model = tmp_path / "x.gguf"
    assert gguf_path(str(model)) == model and gguf_path(f"{model}@f32") == tmp_path / "x.f32.gguf"
