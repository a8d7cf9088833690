import torch

from inferd.engine.model_runner import HUGE_PAGE, zeros_on_huge_pages


def test_zeros_on_huge_pages_is_zeros_of_its_shape_and_dtype():
    for shape, dtype in [((3, 5), torch.float32), ((2, 2, HUGE_PAGE // 64 + 7, 3, 16), torch.bfloat16)]:
        t = zeros_on_huge_pages(shape, dtype)  # the second spans whole huge pages, with a ragged end
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        t.view(-1)[-1] = 1  # writable to its last element
        assert t.sum() == 1
