"""Vision-language policies (Qwen2.5-VL, Qwen3-VL ...): :mod:`~rltk.models.vision.inputs` encodes a prompt's
images with the model's processor and carries each sample's processor outputs through a batch,
:mod:`~rltk.models.vision.tower` finds and freezes the vision tower and clears the rotary offsets Qwen-VL models
keep between forwards, :mod:`~rltk.models.vision.features` reuses a frozen tower's features across one step's
forwards. The tiny VLM default is built in :mod:`rltk.models.tiny`, VLM folders and their processors load in
:mod:`rltk.models.loading`."""
