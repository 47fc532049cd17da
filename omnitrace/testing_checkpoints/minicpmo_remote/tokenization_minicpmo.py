"""MiniCPM-o 4.5's tokenizer class for a tiny test checkpoint (loaded with trust_remote_code): a
fast tokenizer with the marker ids and strings vLLM's processor finds spans by."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

# Marker strings by the names the processor reads; each is one special token.
_MARKERS = {
    "im_start": "<image>",
    "im_end": "</image>",
    "slice_start": "<slice>",
    "slice_end": "</slice>",
    "im_id_start": "<image_id>",
    "im_id_end": "</image_id>",
    "audio_start": "<audio>",
    "audio_end": "</audio>",
    "spk_start": "<spk>",
    "spk_end": "</spk>",
}


class MiniCPMOTokenizerFast(PreTrainedTokenizerFast):
    """A fast tokenizer that names MiniCPM-o's marker tokens and their ids."""

    def _marker_id(self, name: str) -> int:
        token_id: int = self.convert_tokens_to_ids(_MARKERS[name])
        return token_id

    @property
    def im_start(self) -> str:
        """The token that opens an image's thumbnail."""
        return _MARKERS["im_start"]

    @property
    def im_end(self) -> str:
        """The token that closes an image's thumbnail."""
        return _MARKERS["im_end"]

    @property
    def slice_start(self) -> str:
        """The token that opens one slice of an image."""
        return _MARKERS["slice_start"]

    @property
    def slice_end(self) -> str:
        """The token that closes one slice of an image."""
        return _MARKERS["slice_end"]

    @property
    def im_id_start(self) -> str:
        """The token before an image's index."""
        return _MARKERS["im_id_start"]

    @property
    def im_id_end(self) -> str:
        """The token after an image's index."""
        return _MARKERS["im_id_end"]

    @property
    def audio_start(self) -> str:
        """The token that opens an audio chunk."""
        return _MARKERS["audio_start"]

    @property
    def audio_end(self) -> str:
        """The token that closes an audio chunk."""
        return _MARKERS["audio_end"]

    @property
    def spk_start(self) -> str:
        """The token that opens a speaker embedding."""
        return _MARKERS["spk_start"]

    @property
    def spk_end(self) -> str:
        """The token that closes a speaker embedding."""
        return _MARKERS["spk_end"]

    @property
    def im_start_id(self) -> int:
        """The id of :attr:`im_start`."""
        return self._marker_id("im_start")

    @property
    def im_end_id(self) -> int:
        """The id of :attr:`im_end`."""
        return self._marker_id("im_end")

    @property
    def slice_start_id(self) -> int:
        """The id of :attr:`slice_start`."""
        return self._marker_id("slice_start")

    @property
    def slice_end_id(self) -> int:
        """The id of :attr:`slice_end`."""
        return self._marker_id("slice_end")

    @property
    def audio_start_id(self) -> int:
        """The id of :attr:`audio_start`."""
        return self._marker_id("audio_start")

    @property
    def audio_end_id(self) -> int:
        """The id of :attr:`audio_end`."""
        return self._marker_id("audio_end")

    @property
    def spk_start_id(self) -> int:
        """The id of :attr:`spk_start`."""
        return self._marker_id("spk_start")

    @property
    def spk_end_id(self) -> int:
        """The id of :attr:`spk_end`."""
        return self._marker_id("spk_end")

    @property
    def bos_id(self) -> int | None:
        """The begin-of-sequence id (None: the model has no such token)."""
        token_id: int | None = self.bos_token_id
        return token_id

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id."""
        token_id: int | None = self.eos_token_id
        return token_id

    @property
    def unk_id(self) -> int | None:
        """The id of ``<unk>``, the token every embedding position holds."""
        token_id: int | None = self.unk_token_id
        return token_id
