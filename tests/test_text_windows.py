"""What the text encoders read of a prompt: each family counts a prompt's tokens as its pipeline does, set-up says
which prompts run past a window and the setting that keeps them whole, the doctor fails a window
``model.max_sequence_length`` cuts, and an editing family that refuses longer prompts refuses them before any is
encoded."""

from __future__ import annotations

import pytest

from conftest import run_cli
from jagg_core.config import ModelConfig
from jagg_core.doctor import text_window_check
from jagg_core.edit_prompts import EditPrompt
from jagg_core.errors import UserError
from jagg_core.hub import write_model_card
from jagg_core.models import TINY_BUILDERS, load_flow_model
from jagg_core.models.text_windows import TextWindow, WindowReading, prompt_notes, refuse_overlong, window_lines
from jagg_core.rundir import RunDirectory

SHORT, LONG = "a red circle", "a " + "very " * 30 + "big blue square on the left"


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-zimage", "tiny-wan"])
def test_a_prompts_count_is_the_tokens_its_encoder_reads(name):
    """Where the conditioning shows the tokens read (a mask, or zero states past the last token), the count is
    them; a prompt longer than the window counts past it, and the window reads its first ``limit`` tokens."""
    model = load_flow_model(ModelConfig(name=name, max_sequence_length=64))
    cond = model.encode_prompts([SHORT, LONG])
    read = cond.get("prompt_embeds_mask", cond["prompt_embeds"].abs().sum(-1) > 0).sum(-1).tolist()
    [window] = model.text_windows()
    counts = window.count([SHORT, LONG])
    assert read[0] == counts[0] < 64 < counts[1] and read[1] == 64
    assert window.setting == "model.max_sequence_length" and not window.refused


@pytest.mark.parametrize("name", sorted(TINY_BUILDERS))
def test_every_family_counts_its_prompts_in_each_encoder_it_has(name):
    edits = name in ("tiny-flux-kontext", "tiny-qwen-edit", "tiny-qwen-edit-plus", "tiny-wan-i2v", "tiny-wan-i2v-a14b")
    frames = 5 if name.startswith("tiny-wan-i2v") else 1  # an image-to-video model makes frames after its input image
    model = load_flow_model(ModelConfig(name=name, max_sequence_length=48), num_frames=frames)
    prompts = [EditPrompt(text, model_image(), "red.png") for text in (SHORT, LONG)] if edits else [SHORT, LONG]
    readings = model.read_text_windows(prompts * 2)  # a prompt counts once
    assert readings and all(r.prompts == 2 and r.longest > 48 for r in readings)
    sized = [r for r in readings if r.window.setting]
    assert sized or name in ("tiny-sd3", "bench-sd3-31m")  # SD3 without T5 reads CLIP only
    assert all(r.window.limit == 48 and r.over == 1 for r in sized)


def model_image() -> bytes:
    import io

    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("name", ["tiny-qwen-edit", "tiny-qwen-edit-plus"])
def test_qwen_edit_refuses_a_longer_instruction_before_encoding_and_takes_one_that_fits_exactly(name):
    """The count is exact at the window's edge: at ``max_sequence_length`` = the instruction's count the pipeline's
    encoding fits; one token less, set-up refuses it, as the encoding itself would."""
    row = EditPrompt(SHORT, model_image(), "red.png")
    [window] = load_flow_model(ModelConfig(name=name)).text_windows()
    tokens = window.count([SHORT])[0]
    fits = load_flow_model(ModelConfig(name=name, max_sequence_length=tokens))
    refuse_overlong(fits.read_text_windows([row]))
    fits.encode_prompts([row])
    short = load_flow_model(ModelConfig(name=name, max_sequence_length=tokens - 1))
    with pytest.raises(UserError, match=f"1 of 1 prompts take more than the {tokens - 1} text tokens Qwen2.5-VL is "
                                        rf"given \(model.max_sequence_length\), the longest {tokens}: set "
                                        f"model.max_sequence_length={tokens} or shorten them"):
        refuse_overlong(short.read_text_windows([row]))
    with pytest.raises(UserError, match="raise model.max_sequence_length"):
        short.encode_prompts([row])


def test_the_lines_and_the_doctor_tell_a_cut_window_from_a_fixed_one():
    def reading(setting, over, longest=80):
        return WindowReading(TextWindow("T5" if setting else "CLIP", 77, len, setting), 10, over, longest)

    clip, t5 = reading(None, 3), reading("model.max_sequence_length", 2, 120)
    assert window_lines([clip, t5]) == [
        "CLIP reads the first 77 tokens of a prompt (its window is fixed): 3 of 10 prompts are longer, the longest "
        "80 tokens",
        "2 of 10 prompts are longer than the 77 tokens T5 reads (model.max_sequence_length) and lose their ends, the "
        "longest 120 tokens: set model.max_sequence_length=120 to keep them whole"]
    assert window_lines([reading("model.max_sequence_length", 0, 40)]) == []
    assert text_window_check([clip]).status == "pass"  # nothing to set: the doctor reports it
    assert "(3 of 10 are longer)" in text_window_check([clip]).detail
    check = text_window_check([clip, t5])
    assert check.status == "fail" and check.fix.startswith("set model.max_sequence_length=120 to keep every prompt")
    one = WindowReading(TextWindow("T5", 77, len, "model.max_sequence_length"), 1, 1, 90)  # a prompt of one's own
    assert prompt_notes([one]) == ["T5 reads the first 77 of the 90 tokens of the prompt (the run's "
                                   "model.max_sequence_length); the rest is cut"]
    refused = WindowReading(TextWindow("Qwen2.5-VL", 77, len, "model.max_sequence_length", refused=True), 1, 1, 90)
    with pytest.raises(UserError, match=r"the prompt takes 90 text tokens, more than the 77 Qwen2.5-VL is given "
                                        r"\(the run's model.max_sequence_length\): shorten it"):
        prompt_notes([refused])


def test_a_run_says_which_prompts_its_t5_cuts_its_doctor_fails_with_the_setting_and_try_it_notes_it(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([SHORT, LONG, "a green triangle", "a yellow star", "a pink heart"]) + "\n")
    run_dir = tmp_path / "run"
    result = run_cli("--preset", "tiny-sd3", "--output-dir", str(run_dir), "--doctor",
                     "--set", "model.name=tiny-flux", "--set", "model.max_sequence_length=32",
                     "--set", f"prompts.source={prompts}", "--set", "prompts.eval_count=2",
                     "--set", "sampling.num_steps=4", "--set", "backward.window=2", "--set", "grpo.num_generations=2",
                     "--set", "model.guidance_scale=2", "--set", f"model.negative_prompt={LONG}")
    assert result.returncode == 1, result.stdout + result.stderr
    longest = load_flow_model(ModelConfig(name="tiny-flux")).text_windows()[1].count([LONG])[0]
    line = (f"1 of 5 prompts are longer than the 32 tokens T5 reads (model.max_sequence_length) and lose their ends, "
            f"the longest {longest} tokens: set model.max_sequence_length={longest} to keep them whole")
    assert line in result.stdout + result.stderr and line in RunDirectory(run_dir).log_file.read_text()
    assert "CLIP reads the first 77 tokens of a prompt (its window is fixed): 1 of 5 prompts are longer" in \
        result.stdout + result.stderr
    assert (f"T5 reads the first 32 of the {longest} tokens of model.negative_prompt (the run's "
            "model.max_sequence_length); the rest is cut") in result.stdout + result.stderr  # CFG's, beside each
    [check] = [c for c in RunDirectory(run_dir).read_doctor()["checks"]
               if c["check"] == "the prompts fit the text encoders' windows"]
    assert check["status"] == "fail" and check["fix"].startswith(f"set model.max_sequence_length={longest} ")
    card = write_model_card(run_dir, "alice/cut").text  # who samples the adapter knows what it was trained to read
    assert ("- **Text:** the encoders read the prompts' first tokens: CLIP 77, 1 of 5 prompts longer and cut; T5 32 "
            "(`model.max_sequence_length`), 1 of 5 prompts longer and cut\n") in card
    from app.ui import Studio  # Try it: a prompt of one's own that T5 cuts is sampled cut, and the page says so
    studio = Studio(tmp_path)
    image, message = studio.generate("run", "latest adapter", LONG, 0)
    assert image and message.endswith(f"  \n**Note:** T5 reads the first 32 of the {longest} tokens of the prompt "
                                      "(the run's model.max_sequence_length); the rest is cut"), message
    # a text-to-image run shows no image box; an input image sent anyway (the API) is refused
    assert [update["visible"] for update in studio.try_inputs("run")] == [False] * 4  # no image, no whole picture
    upload = tmp_path / "input.png"
    upload.write_bytes(model_image())
    assert studio.generate("run", "latest adapter", SHORT, 0, str(upload))[1] == (
        "**Not generated:** the run's model (FLUX.1) generates from the prompt alone; leave out the input image")
