"""VQAScore (Lin et al. 2024, arXiv 2404.01291): how sure a vision-language model is that an image shows its prompt.

``vqa_score = P(answer | image, question(prompt))``: the chat model (transformers ``AutoModelForImageTextToText``
with its ``AutoProcessor``, Qwen2.5-VL-3B-Instruct by default) is shown the image and asked ``options.question``
(by default VQAScore's ``Does this figure show "{prompt}"? Please answer yes or no.``) in its chat template; the
score is the softmax probability, over the whole vocabulary, of the one token of ``options.answer`` ("Yes") as the
first token of its reply. In ``[0, 1]``: a prompt-following reward (or judge) that reads counts, colours, positions
and text, where CLIP's embeddings read a bag of words. For an image-editing row the model is shown the input image
then the output and asked ``options.edit_question`` about the instruction (by default whether the second image is the
first edited as it says), in the manner of VIEScore's instruction-following check.

The model loads in the catalog's ``dtype_on`` the device (bfloat16 on a GPU, float32 on the CPU), once, on first call;
the images are scored ``options.batch_size`` at a time (their pixels in the model's dtype), left-padded so that every
row's reply starts at the last position. Its processor is the model's own ``AutoProcessor`` (Qwen2.5-VL's has a
video part, which needs torchvision: the catalog's ``requires``, checked before a launch).
"""

from __future__ import annotations

from functools import cached_property

import torch

from ..errors import UserError
from ..hubclient import hub_model
from ..images import to_pil
from .base import Reward
from .catalog import check_reward_packages, reward_entry


def load_vlm(model_id: str, device: torch.device):
    """``(model, processor)`` of a chat vision-language model, in eval mode on ``device`` without gradients, its
    tokenizer padding on the left."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    check_reward_packages([VqaScore.name])
    dtype = getattr(torch, reward_entry(VqaScore.name).dtype_on(device.type))
    not_a_vlm = UserError(f"'{model_id}' is not a chat vision-language model with an image-and-text processor; "
                          "the vqa_score reward needs one, such as Qwen/Qwen2.5-VL-3B-Instruct (options.model_id)")
    with hub_model(model_id):
        config = AutoConfig.from_pretrained(model_id)
        if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            raise not_a_vlm
        model = AutoModelForImageTextToText.from_pretrained(model_id, config=config, dtype=dtype)
        processor = AutoProcessor.from_pretrained(model_id)
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise not_a_vlm
    processor.tokenizer.padding_side = "left"
    return model.eval().requires_grad_(False).to(device), processor


def answer_token(tokenizer, answer: str) -> int:
    """The id of the one token ``answer`` is; an answer of several tokens is a one-line error."""
    ids = tokenizer.encode(answer, add_special_tokens=False)
    if len(ids) != 1:
        raise UserError(f"the vqa_score answer {answer!r} is {len(ids)} tokens for this model's tokenizer; choose a "
                        "one-token answer (options.answer), such as Yes")
    return ids[0]


class VqaScore(Reward):
    """``P(answer | image, question(prompt))`` of a chat vision-language model (module docstring)."""

    name = "vqa_score"
    takes_inputs = True

    @cached_property
    def vlm(self):
        return load_vlm(self.options.model_id, self.device)

    def chat_texts(self, prompts: list[str], images_a_row: int) -> list[str]:
        """Each prompt's question as the model's chat template writes a user turn of ``images_a_row`` images and the
        question (``options.question``; for an edit, input then output, ``options.edit_question``), with the
        assistant's reply opened."""
        _, processor = self.vlm
        question = self.options.question if images_a_row == 1 else self.options.edit_question
        return [processor.apply_chat_template(
            [{"role": "user", "content": [*[{"type": "image"}] * images_a_row,
                                          {"type": "text", "text": question.format(prompt=prompt)}]}],
            add_generation_prompt=True, tokenize=False) for prompt in prompts]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], inputs: torch.Tensor | None = None) -> torch.Tensor:
        model, processor = self.vlm
        answer = answer_token(processor.tokenizer, self.options.answer)
        prompts = [getattr(prompt, "instruction", prompt) for prompt in prompts]  # an edit row: its instruction
        shown = [images] if inputs is None else [inputs, images]  # a row's pictures, in the question's order
        scores = []
        for start in range(0, len(prompts), self.options.batch_size):
            end = start + self.options.batch_size
            rows = zip(*(to_pil(pictures[start:end]) for pictures in shown))
            encoded = processor(text=self.chat_texts(prompts[start:end], len(shown)),
                                images=[picture for row in rows for picture in row], padding=True,
                                return_tensors="pt").to(self.device, dtype=model.dtype)
            logits = model(**encoded, logits_to_keep=1).logits[:, -1]  # left-padded: every reply's first token
            scores.append(logits.float().softmax(-1)[:, answer].cpu())
        return torch.cat(scores)
