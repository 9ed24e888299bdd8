"""Chat templates that mark assistant turns for label masking (no torch: the offline path keys caches on them).

Label masking uses Hugging Face's own machinery: each assistant turn sits inside
``{% generation %} ... {% endgeneration %}`` and ``apply_chat_template(return_assistant_tokens_mask=True)``
maps those character spans onto tokens. :func:`resolve_chat_template` picks the template to render with.
"""

from __future__ import annotations

import re
from typing import Any

# ChatML with Qwen-VL vision markers; assistant turns (content + <|im_end|>) sit inside a generation block so
# that they, and only they, get labels. Newlines are emitted as expressions because HF renders templates with
# trim_blocks=True, which would eat a literal newline that follows a tag.
CHATML_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ render(message['content']) }}{{ '<|im_end|>' }}{% endgeneration %}"
    "{%- else -%}{{ render(message['content']) }}{{ '<|im_end|>' }}"
    "{%- endif -%}"
    "{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


# Gemma-style turns (``<start_of_turn>user`` ... ``<end_of_turn>``, assistant role named ``model``) with Gemma 3's
# image placeholder ``<start_of_image>`` (the processor expands it to the image's soft tokens); assistant
# content and its ``<end_of_turn>`` sit inside a generation block.
GEMMA_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- set body -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<start_of_image>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endset -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ body }}{{ '<end_of_turn>' }}{% endgeneration %}"
    "{%- else -%}{{ body }}{{ '<end_of_turn>' }}"
    "{%- endif -%}"
    "{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


# The jinja tag HF uses to record assistant spans ("add_generation_prompt" must not count).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def resolve_chat_template(processor: Any, chat_template: str | None) -> str:
    """The template to render with: the caller's, else the processor's if it marks assistant spans, else ChatML.

    Label masking needs ``{% generation %}`` blocks. Falling back to our ChatML template is only done for
    ChatML tokenizers (they know ``<|im_start|>``); anything else must bring its own marked template.
    """
    if chat_template is not None:
        template = chat_template
    else:
        own = getattr(processor, "chat_template", None)
        if isinstance(own, str) and _GENERATION_TAG.search(own):
            return own
        tokenizer = getattr(processor, "tokenizer", processor)
        if tokenizer.convert_tokens_to_ids("<|im_start|>") in (None, tokenizer.unk_token_id):
            raise ValueError(
                "the processor's chat template has no {% generation %} block, so assistant turns cannot be "
                "located for label masking, and the tokenizer is not ChatML. Pass chat_template=... with the "
                "assistant content wrapped in {% generation %}...{% endgeneration %}."
            )
        return CHATML_TEMPLATE
    if not _GENERATION_TAG.search(template):
        raise ValueError(
            "chat_template has no {% generation %} block: wrap each assistant turn's content (and its end token) "
            "in {% generation %}...{% endgeneration %} so labels can be set on assistant tokens only."
        )
    return template
