/* Generated from recorder/record.py by `python recorder/record.py`: do not edit.
 * The recorder's row tuple, field by field (see record.OPS). */
#ifndef TRACELAKE_RECORD_H
#define TRACELAKE_RECORD_H
#define ROW_WIDTH 19
#define ROW_PASS 0
#define ROW_FUNC 1
#define ROW_KIND 2
#define ROW_MODULES 3
#define ROW_SHAPE 4
#define ROW_DTYPE 5
#define ROW_DEVICE 6
#define ROW_OUT_INDEX 7
#define ROW_INPLACE 8
#define ROW_PARAMS 9
#define ROW_LAYER_IDX 10
#define ROW_N_FUNC 11
#define ROW_N_LAYER 12
#define ROW_INTERVENED 13
#define ROW_RULE 14
#define ROW_PARENTS 15
#define ROW_PARENT_ARGS 16
#define ROW_SITE 17
#define ROW_ARG_VALUES 18
#define ROW_FIELD_NAMES "pass,func,kind,modules,shape,dtype,device,out_index,inplace,params,layer_idx,n_func,n_layer,intervened,rule,parents,parent_args,site,arg_values"
#endif
