"""Image inputs of vision-language requests: preprocessing identical to HF's, bad images refused with a
clear ``ValueError`` (nothing left behind in the engine), local files only under the allowed folder,
engine-side validation of ``AddRequest.images``, and the make-tiny VL checkpoints."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import msgspec
import numpy as np
import pytest

from tests.xengine.vl_oracle import data_url, random_image, user_turn
from xengine.api.chat_images import ChatImageBuilder
from xengine.api.image_processing import ImageProcessor
from xengine.api.media import MediaLimits
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_dir(make_model_dir):
    return make_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def llm(vl_dir, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    random_image(56, 56, seed=1).save(media / "small.png")
    return LLM(str(vl_dir), block_size=4, allowed_local_media_path=str(media))


@pytest.mark.parametrize(
    ("height", "width", "mode"),
    [
        (56, 56, "RGB"),
        (84, 112, "RGB"),
        (300, 200, "RGBA"),
        (1000, 700, "RGB"),
        (10, 20, "L"),
        (57, 95, "RGB"),
    ],
)
def test_preprocessing_matches_hf(vl_dir, height, width, mode):
    """Resize (up, down, to multiples of 28), RGB conversion (alpha onto white, grey), normalisation and
    patch order: the same float32 array and grid as HF's PIL image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = random_image(height, width, seed=height * width, mode=mode)
    ref = Qwen2VLImageProcessorPil.from_pretrained(str(vl_dir))(images=[image], return_tensors="np")
    patches, grid = ImageProcessor.from_dir(vl_dir)(image)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert patches.dtype == np.float32 and np.array_equal(patches, ref["pixel_values"])


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims ``width x height`` pixels (a decompression-bomb shape)."""
    buf = io.BytesIO()
    random_image(1, 1, seed=0).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _b64(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _image_message(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
        }
    ]


BAD_IMAGES = {
    "corrupt bytes": (_b64(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "cannot decode the image"),
    "not base64": ("data:image/png;base64,%%%not-base64%%%", "not valid base64"),
    "not an image type": (_b64(b"hello", "text/plain"), "unsupported image data URL media type"),
    "svg": (_b64(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"), "supported format"),
    "too many pixels": (_b64(_png_claiming(8_000, 8_000)), "has 8000x8000 pixels, more than the limit"),
    "decompression bomb": (_b64(_png_claiming(20_000, 20_000)), "more pixels than the limit"),
    "network url": ("https://example.com/cat.png", "nothing is fetched from the network"),
    "outside the media folder": ("/etc/hostname", "outside the allowed media folder"),
    "missing local file": ("file:///nonexistent-xllm-media/x.png", "outside the allowed media folder"),
    "no url": (None, "image_url.url"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_are_refused_with_a_clear_message(llm, case):
    url, message = BAD_IMAGES[case]
    with pytest.raises(ValueError, match=message):
        llm.chat(_image_message(url), GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_image_in_a_batch_refuses_the_batch_and_leaves_the_engine_serving(llm):
    good = [user_turn(random_image(56, 56, seed=5), "Fine?")]
    with pytest.raises(ValueError, match=r"image 0: cannot decode"):
        llm.chat([good, _image_message(BAD_IMAGES["corrupt bytes"][0])], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.chat(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_limits_on_bytes_and_count(vl_dir):
    limits = MediaLimits(max_image_bytes=1000, max_images_per_request=2)
    builder = ChatImageBuilder.from_dir(vl_dir, limits=limits)
    big = random_image(100, 100, seed=1)  # PNG of random pixels: ~30 KB
    with pytest.raises(ValueError, match="larger than 1000 bytes"):
        builder.load_images(user_turn_list(big))
    small = random_image(2, 2, seed=1)
    with pytest.raises(ValueError, match="3 images, more than the limit of 2"):
        builder.load_images(user_turn_list(small, small, small))


def user_turn_list(*images) -> list[dict]:
    return [user_turn(*images)]


def test_local_file_under_the_allowed_folder_equals_its_data_url(llm):
    path = llm._images.allowed_local_media_path
    image = random_image(56, 56, seed=1)  # the file written by the fixture
    by_path = llm.chat(_image_message(f"{path}/small.png"), GREEDY, use_tqdm=False)[0]
    by_file_url = llm.chat(_image_message(f"file://{path}/small.png"), GREEDY, use_tqdm=False)[0]
    by_data = llm.chat(_image_message(data_url(image)), GREEDY, use_tqdm=False)[0]
    assert by_path.outputs[0].token_ids == by_file_url.outputs[0].token_ids == by_data.outputs[0].token_ids
    with pytest.raises(ValueError, match="outside the allowed media folder"):
        llm.chat(_image_message(f"{path}/../small.png"), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="does not exist"):
        llm.chat(_image_message(f"{path}/missing.png"), GREEDY, use_tqdm=False)


def test_local_files_refused_without_an_allowed_folder(vl_dir):
    builder = ChatImageBuilder.from_dir(vl_dir)
    with pytest.raises(ValueError, match="local image files are not allowed"):
        builder.load_images(_image_message("/tmp/x.png"))


def test_text_model_refuses_images(make_model_dir):
    llm = LLM(str(make_model_dir("qwen2")))
    with pytest.raises(ValueError, match="does not take images"):
        llm.chat([user_turn(random_image(56, 56, seed=1), "?")], GREEDY, use_tqdm=False)
    image = ChatImageBuilder.from_dir(make_model_dir("qwen2_vl")).processor.image_input(
        random_image(56, 56, 1)
    )
    req = AddRequest(req_id="r", prompt_token_ids=[5] * 10, params=GREEDY, images=[image])
    with pytest.raises(ValueError, match="invalid value for 'images'.*does not take images"):
        llm.engine.add_request(req)


def test_engine_validates_images_against_the_prompt(llm):
    builder, tok = llm._images, llm.tokenizer
    prompt = builder.build(
        tok, [user_turn(random_image(56, 56, seed=7), "What?", random_image(56, 56, seed=8))]
    )
    image = prompt.images[0]
    ok = AddRequest(req_id="ok", prompt_token_ids=prompt.token_ids, params=GREEDY, images=prompt.images)
    llm.engine.add_request(ok)  # accepted as is
    llm.engine.abort_requests(["ok"])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    bad = {
        "content_hash is not the sha256": dict(
            images=[msgspec.structs.replace(image, content_hash="0" * 64), prompt.images[1]]
        ),
        "not all image-pad tokens": dict(
            images=[msgspec.structs.replace(image, offset=image.offset - 1), prompt.images[1]]
        ),
        "8 image-pad tokens, but the images fill 4": dict(images=[image]),  # the second image left out
        "holds .* bytes": dict(images=[msgspec.structs.replace(image, pixel_values=image.pixel_values[:-4])]),
        "length 3 is not 4": dict(images=[msgspec.structs.replace(image, length=3), prompt.images[1]]),
    }
    for i, (message, change) in enumerate(bad.items()):
        fields = dict(
            req_id=f"bad{i}", prompt_token_ids=prompt.token_ids, params=GREEDY, images=prompt.images
        )
        fields.update(change)
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request(AddRequest(**fields))
    assert not llm.engine.has_unfinished_requests()


def test_make_tiny_vl_folder(vl_dir, make_model_dir, tmp_path):
    """The folder loads with HF's image processor and tokenizer (vision tokens special), its chat
    template renders image parts, and the CLI writes the same checkpoint for the same seed."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from xengine.tools.make_tiny import main

    config = json.loads((vl_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(vl_dir))
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    assert ids == [
        config["vision_start_token_id"],
        config["vision_end_token_id"],
        config["image_token_id"],
        config["video_token_id"],
    ]
    assert config["text_config"]["vocab_size"] == len(tok)
    assert Qwen2VLImageProcessorPil.from_pretrained(str(vl_dir)).merge_size == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], tokenize=False
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>hi" in text
    assert main(["--arch", "qwen2_5_vl", "--out", str(tmp_path / "m"), "--quiet"]) == 0
    a, b = (
        load_file(make_model_dir("qwen2_5_vl") / "model.safetensors"),
        load_file(tmp_path / "m" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    assert any(k.startswith("visual.blocks.0.attn") for k in a)
