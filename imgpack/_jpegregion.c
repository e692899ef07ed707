/* A JPEG's region decoded alone, through libjpeg-turbo's partial decompression.
 *
 * decode(data, colorspace, denom, top, bottom, left, right) decodes rows [top, bottom) and
 * columns [left, right) of the image at DCT scale 1/denom (coordinates in the scaled image):
 * the rows above the region are skipped (jpeg_skip_scanlines: entropy-decoded, not
 * transformed), those below are never read, and the columns are cropped to the iMCU
 * boundaries around the region (jpeg_crop_scanline). It returns
 * (pixels, rows, cols, channels, xoffset, scaled_height, scaled_width): `pixels` is a bytearray
 * of rows x cols x channels, and its columns are the scaled image's [xoffset, xoffset + cols),
 * a span that holds [left, right). The decode runs without the GIL.
 *
 * The options are the ones imgpack's other JPEG path uses (simplejpeg's defaults): the accurate
 * integer inverse DCT and fancy upsampling. A warning of damaged data fails the decode
 * (ValueError), as simplejpeg's strict mode does, so the caller falls back to Pillow, which
 * names the damage.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

struct failure {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void fail(j_common_ptr cinfo) {
    struct failure *err = (struct failure *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: the data is damaged */
        fail(cinfo);
    }
}

struct job {
    const unsigned char *data;
    unsigned long size;
    J_COLOR_SPACE space;
    int denom;
    JDIMENSION top, bottom, left, right;
    /* results */
    unsigned char *pixels;
    JDIMENSION rows, cols, xoffset, height, width;
    int channels;
    const char *refused; /* a request that does not fit the image */
};

/* The work of decode() without the GIL: 0 when done, -1 when libjpeg failed (message in err). */
static int run(struct job *job, struct failure *err) {
    struct jpeg_decompress_struct cinfo;
    volatile int created = 0;
    unsigned char *volatile pixels = NULL;

    cinfo.err = jpeg_std_error(&err->pub);
    err->pub.error_exit = fail;
    err->pub.emit_message = message;
    if (setjmp(err->jump)) {
        if (created) {
            jpeg_destroy_decompress(&cinfo);
        }
        free(pixels);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    created = 1;
    jpeg_mem_src(&cinfo, job->data, job->size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = job->space;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->denom;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    job->height = cinfo.output_height;
    job->width = cinfo.output_width;
    if (job->bottom > cinfo.output_height || job->right > cinfo.output_width ||
        job->top >= job->bottom || job->left >= job->right) {
        job->refused = "the region is not inside the image at this scale";
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    JDIMENSION xoffset = job->left, cols = job->right - job->left;
    jpeg_crop_scanline(&cinfo, &xoffset, &cols);
    job->channels = cinfo.output_components;
    size_t stride = (size_t)cinfo.output_width * (size_t)cinfo.output_components;
    size_t rows = job->bottom - job->top;
    pixels = malloc(stride * rows);
    if (pixels == NULL) {
        job->refused = "out of memory";
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    if (job->top > 0 && jpeg_skip_scanlines(&cinfo, job->top) != job->top) {
        strcpy(err->message, "the image ends before the region");
        longjmp(err->jump, 1);
    }
    while (cinfo.output_scanline < job->bottom) {
        JSAMPROW row = pixels + stride * (cinfo.output_scanline - job->top);
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
            strcpy(err->message, "the image ends inside the region");
            longjmp(err->jump, 1);
        }
    }
    job->pixels = pixels;
    job->rows = (JDIMENSION)rows;
    job->cols = cinfo.output_width;
    job->xoffset = xoffset;
    jpeg_abort_decompress(&cinfo); /* the rows below the region are not needed */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    const char *colorspace;
    int denom;
    unsigned int top, bottom, left, right;
    if (!PyArg_ParseTuple(args, "y*siIIII", &data, &colorspace, &denom, &top, &bottom, &left,
                          &right)) {
        return NULL;
    }
    struct job job;
    memset(&job, 0, sizeof(job));
    if (strcmp(colorspace, "rgb") == 0) {
        job.space = JCS_RGB;
    } else if (strcmp(colorspace, "gray") == 0) {
        job.space = JCS_GRAYSCALE;
    } else {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "colorspace must be 'rgb' or 'gray'");
        return NULL;
    }
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8");
        return NULL;
    }
    job.data = data.buf;
    job.size = (unsigned long)data.len;
    job.denom = denom;
    job.top = top;
    job.bottom = bottom;
    job.left = left;
    job.right = right;
    struct failure err;
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = run(&job, &err);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&data);
    if (status != 0) {
        PyErr_Format(PyExc_ValueError, "cannot decode the JPEG: %s", err.message);
        return NULL;
    }
    if (job.refused != NULL) {
        PyErr_Format(PyExc_ValueError, "cannot decode the region: %s", job.refused);
        return NULL;
    }
    size_t size = (size_t)job.rows * job.cols * (size_t)job.channels;
    PyObject *pixels = PyByteArray_FromStringAndSize((const char *)job.pixels, (Py_ssize_t)size);
    free(job.pixels);
    if (pixels == NULL) {
        return NULL;
    }
    return Py_BuildValue("(NIIiIII)", pixels, job.rows, job.cols, job.channels, job.xoffset,
                         job.height, job.width);
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, colorspace, denom, top, bottom, left, right) -> (pixels, rows, cols, "
     "channels, xoffset, scaled_height, scaled_width): rows [top, bottom) of a JPEG at DCT "
     "scale 1/denom, columns [xoffset, xoffset + cols), a span holding [left, right)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegregion",
    "A JPEG's region decoded alone (libjpeg-turbo's partial decompression).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegregion(void) { return PyModule_Create(&module); }
